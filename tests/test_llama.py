"""The Llama preset's layers and model: RMSNorm, SwiGLU, the block and the whole model
against an independent float64 PyTorch build (max rel err <= 1e-10 per layer), central
finite differences, and 20 AdamW training steps against torch.optim.AdamW (rel <= 1e-9)."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.check.finite_diff import central_difference
from attngrad.layers.norm import norm_backward, norm_forward
from attngrad.layers.rmsnorm import rmsnorm_backward, rmsnorm_forward
from attngrad.layers.swiglu import init_swiglu, swiglu_backward, swiglu_forward
from attngrad.models import MODELS
from attngrad.models.llama import (
    LlamaConfig,
    init_llama_block,
    llama_block_backward,
    llama_block_forward,
)
from conftest import assert_close_rel, assert_gradcheck, directional_check

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(2024)


def t(a):
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


# ---------------------------------------------------------------- the PyTorch build (float64)


def t_rms(x, w, eps):
    """Llama's RMSNorm: x * rsqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def t_rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def t_rope(x, pos, base):
    """Llama / GPT-NeoX: x * cos + rotate_half(x) * sin, x (B, H, L, D), pos (L,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.as_tensor(pos, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + t_rotate_half(x) * emb.sin()


def t_swiglu(h, p, pre):
    return (F.silu(h @ p[pre + "W_gate"]) * (h @ p[pre + "W_up"])) @ p[pre + "W_down"]


def t_attention(p, pre, x, cfg: LlamaConfig):
    b, n, e = x.shape
    h, hkv = cfg.heads, cfg.num_kv_heads
    d = e // h
    q = (x @ p[pre + "W_q"]).view(b, n, h, d).transpose(1, 2)
    k = (x @ p[pre + "W_k"]).view(b, n, hkv, d).transpose(1, 2)
    v = (x @ p[pre + "W_v"]).view(b, n, hkv, d).transpose(1, 2)
    if cfg.qk_norm == "rms":
        q, k = t_rms(q, p[pre + "q_norm_w"], cfg.eps), t_rms(k, p[pre + "k_norm_w"], cfg.eps)
    elif cfg.qk_norm == "layer":
        q = F.layer_norm(q, (d,), p[pre + "q_norm_w"], None, cfg.eps)
        k = F.layer_norm(k, (d,), p[pre + "k_norm_w"], None, cfg.eps)
    pos = np.arange(n)
    q, k = t_rope(q, pos, cfg.rope_base), t_rope(k, pos, cfg.rope_base)
    k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b, n, e) @ p[pre + "W_o"]


def t_block(p, pre, x, cfg):
    x = x + t_attention(p, pre + "attn.", t_rms(x, p[pre + "attn_norm.g"], cfg.eps), cfg)
    return x + t_swiglu(t_rms(x, p[pre + "ffn_norm.g"], cfg.eps), p, pre + "ffn.")


def t_logits(p, cfg: LlamaConfig, ids):
    x = p["emb.W"][torch.from_numpy(ids)]
    for i in range(cfg.layers):
        x = t_block(p, f"layers.{i}.", x, cfg)
    h = t_rms(x, p["norm.g"], cfg.eps)
    return h @ (p["emb.W"].T if cfg.tie_embeddings else p["out.W"])


# ---------------------------------------------------------------- RMSNorm and SwiGLU


def test_rmsnorm_matches_torch_and_finite_differences():
    x = 3.0 * RNG.standard_normal((2, 5, 6)) + 0.5
    p = {"g": RNG.standard_normal(6)}
    g = RNG.standard_normal(x.shape)
    y, c = rmsnorm_forward(p, x, eps=1e-6)
    dx, grads = rmsnorm_backward(g, c)
    tx, tg = t(x), t(p["g"])
    ty = t_rms(tx, tg, 1e-6)
    ty.backward(torch.tensor(g))
    assert_close_rel({"y": y, "dx": dx, "g": grads["g"]},
                     {"y": ty.detach().numpy(), "dx": tx.grad.numpy(), "g": tg.grad.numpy()})
    if hasattr(F, "rms_norm"):  # PyTorch's own, where it has one
        np.testing.assert_allclose(y, F.rms_norm(torch.tensor(x), (6,), torch.tensor(p["g"]), 1e-6), rtol=1e-12)
    assert_gradcheck(dx, central_difference(lambda v: float(np.sum(rmsnorm_forward(p, v)[0] * g)), x))
    assert_gradcheck(grads["g"], central_difference(
        lambda v: float(np.sum(rmsnorm_forward({"g": v}, x)[0] * g)), p["g"]))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_zero_input_is_finite(kind):
    """x = 0 (a padded row): rstd = 1/sqrt(eps), y = 0, gradients finite."""
    x = np.zeros((2, 3, 4))
    y, c = norm_forward(x, np.ones(4), kind=kind, eps=1e-6)
    dx, dw = norm_backward(np.ones_like(x), c)
    assert np.all(y == 0) and np.all(np.isfinite(dx)) and np.all(dw == 0)


def test_swiglu_matches_torch_and_finite_differences():
    e, f = 6, 10
    p = init_swiglu(e, f, RNG)
    h = RNG.standard_normal((2, 4, e))
    h[0, 0] *= 30.0  # large pre-activations: the sigmoid must not overflow
    g = RNG.standard_normal((2, 4, e))
    y, c = swiglu_forward(p, h)
    dh, grads = swiglu_backward(g, c)
    tp = {k: t(v) for k, v in p.items()}
    th = t(h)
    ty = t_swiglu(th, tp, "")
    ty.backward(torch.tensor(g))
    ref = {"y": ty.detach().numpy(), "dh": th.grad.numpy(), **{k: v.grad.numpy() for k, v in tp.items()}}
    assert_close_rel({"y": y, "dh": dh, **grads}, ref)
    assert_gradcheck(dh, central_difference(lambda v: float(np.sum(swiglu_forward(p, v)[0] * g)), h))
    for k in p:
        num = central_difference(lambda v, k=k: float(np.sum(swiglu_forward({**p, k: v}, h)[0] * g)), p[k])
        assert_gradcheck(grads[k], num, k)
    with pytest.raises(ValueError, match="W_up"):
        swiglu_forward({"W_gate": p["W_gate"], "W_down": p["W_down"]}, h)


# ---------------------------------------------------------------- the block


BLOCKS = {
    "mha": dict(heads=2),
    "gqa": dict(heads=4, kv_heads=2),
    "gqa-qknorm-rms": dict(heads=4, kv_heads=1, qk_norm="rms"),
    "mha-qknorm-layer-base": dict(heads=2, qk_norm="layer", rope_base=500.0),
}


@pytest.mark.parametrize("case", sorted(BLOCKS))
def test_block_matches_torch_and_finite_differences(case):
    cfg = LlamaConfig(vocab=5, dim=8, ffn=12, dtype="float64", **BLOCKS[case])
    rng = np.random.default_rng(len(case))
    p = init_llama_block(cfg, rng, "float64")
    for k in p:  # non-trivial norm weights
        if k.endswith((".g", "_norm_w")):
            p[k] = 1.0 + 0.3 * rng.standard_normal(p[k].shape)
    x = rng.standard_normal((2, 5, 8))
    g = rng.standard_normal(x.shape)
    y, c = llama_block_forward(p, x, cfg)
    dx, grads = llama_block_backward(g, c)
    assert grads.keys() == p.keys()
    tp = {k: t(v) for k, v in p.items()}
    tx = t(x)
    ty = t_block(tp, "", tx, cfg)
    ty.backward(torch.tensor(g))
    ref = {"y": ty.detach().numpy(), "dx": tx.grad.numpy(), **{k: v.grad.numpy() for k, v in tp.items()}}
    assert_close_rel({"y": y, "dx": dx, **grads}, ref, what=f"{case} ")

    def loss_of(name):
        def loss(v):
            if name == "x":
                return float(np.sum(llama_block_forward(p, v, cfg)[0] * g))
            return float(np.sum(llama_block_forward({**p, name: v}, x, cfg)[0] * g))
        return loss

    directional_check(loss_of("x"), x, dx, rng, what=f"{case} dx")
    for k in p:
        directional_check(loss_of(k), p[k], grads[k], rng, n_dirs=2, what=f"{case} {k}")


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("tied", [False, True])
def test_model_gradients_match_torch(tied):
    cfg = LlamaConfig(vocab=9, dim=8, heads=4, kv_heads=2, ffn=12, layers=2, tie_embeddings=tied,
                      dtype="float64")
    model = MODELS["llama"]
    p = model.init(cfg, 3)
    assert ("out.W" in p) is not tied
    assert not any(k.startswith("layers.0.attn.b_") for k in p)  # no biases
    ids = np.random.default_rng(4).integers(0, 9, (3, 6))
    g = np.random.default_rng(5).standard_normal((3, 6, 9))
    logits, cache = model.forward(p, cfg, ids)
    grads = model.backward(g, cache)
    assert grads.keys() == p.keys()
    tp = {k: t(v) for k, v in p.items()}
    tl = t_logits(tp, cfg, ids)
    tl.backward(torch.tensor(g))
    ref = {"logits": tl.detach().numpy(), **{k: v.grad.numpy() for k, v in tp.items()}}
    assert_close_rel({"logits": logits, **grads}, ref)
    maps = model.attention_maps(cache)["decoder_causal"]
    assert len(maps) == 2 and maps[0].shape == (3, 4, 6, 6)
    np.testing.assert_allclose(maps[0].sum(-1), 1.0)
    assert np.all(np.triu(maps[0][0, 0], 1) == 0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(heads=3), "divide"),
        (dict(dim=12, heads=4), "even for RoPE"),
        (dict(kv_heads=3), "kv_heads"),
        (dict(qk_norm="l2"), "qk_norm"),
        (dict(rope_base=-1.0), "base"),
        (dict(rope_layout="gptj"), "layout"),
        (dict(eps=0.0), "eps"),
        (dict(dtype="float16"), "dtype"),
    ],
)
def test_config_errors_name_the_option(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        LlamaConfig(vocab=8, **{"dim": 8, "heads": 2, **kwargs})


# ---------------------------------------------------------------- 20 AdamW steps (the preset)


PARITY = {
    "untied-mha": dict(),
    "tied-gqa-qknorm": dict(kv_heads=2, tie_embeddings=True, qk_norm="rms"),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_twenty_adamw_steps_match_pytorch(case):
    from attngrad.train import data as D
    from attngrad.train.loop import TrainConfig, loss_and_grads, train_step
    from attngrad.train.optim import AdamWConfig, adamw_init, lr_at

    tol = 1e-9
    cfg = TrainConfig(task="reverse", model="llama", steps=20, batch_size=6, symbols=6, min_len=3,
                      max_len=6, dim=16, heads=4, ffn=24, layers=2, seed=7, dtype="float64",
                      label_smoothing=0.1 if "qknorm" in case else 0.0,
                      optim=AdamWConfig(lr=3e-3, warmup=5, clip=0.5), **PARITY[case])
    mcfg = cfg.model_config
    params = MODELS["llama"].init(mcfg, cfg.seed)
    opt = adamw_init(params)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    oc = cfg.optim
    groups = [
        {"params": [tp[k] for k in params if params[k].ndim >= 2], "weight_decay": oc.weight_decay},
        {"params": [tp[k] for k in params if params[k].ndim < 2], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False)
    stream = D.BatchStream(cfg.task_config, cfg.model, cfg.batch_size, cfg.seed)

    def rel(a, r):
        return float(np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-300))

    clipped = 0
    for step in range(1, cfg.steps + 1):
        batch = stream.next()
        loss, grads, _ = loss_and_grads(params, cfg, batch, None)
        topt.zero_grad()
        logits = t_logits(tp, mcfg, batch["inp"])
        tloss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(batch["tgt"]).reshape(-1),
                                ignore_index=D.PAD, label_smoothing=cfg.label_smoothing)
        tloss.backward()
        assert abs(loss - tloss.item()) <= tol * abs(tloss.item()), (step, loss, tloss.item())
        assert grads.keys() == tp.keys()
        for k, g in grads.items():
            assert rel(g, tp[k].grad.numpy()) <= tol, (step, k, rel(g, tp[k].grad.numpy()))
        params, opt, rec = train_step(params, opt, batch, cfg, step)
        norm = torch.nn.utils.clip_grad_norm_(list(tp.values()), oc.clip)
        clipped += float(norm) > oc.clip
        assert abs(rec["grad_norm"] - float(norm)) <= tol * float(norm)
        for g in topt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, oc)
        topt.step()
        for k, v in params.items():
            assert rel(v, tp[k].detach().numpy()) <= tol, (step, k)
    assert clipped > 0, "the clipping path was never exercised"


def test_train_config_llama_options():
    from attngrad.train.loop import TrainConfig

    with pytest.raises(ValueError, match="qk_norm: an option of model='llama' only"):
        TrainConfig(model="decoder", qk_norm="rms")
    with pytest.raises(ValueError, match="kv_heads"):
        TrainConfig(model="llama", kv_heads=3)
    with pytest.raises(ValueError, match="no dropout"):
        TrainConfig(model="llama", dropout=0.1)
    cfg = TrainConfig(model="llama", kv_heads=2, tie_embeddings=True, qk_norm="layer").model_config
    assert (cfg.num_kv_heads, cfg.tie_embeddings, cfg.qk_norm) == (2, True, "layer")


def test_llama_run_resumes_bit_for_bit(tmp_path):
    """A --model llama run stopped at a checkpoint and resumed equals the uninterrupted run."""
    from attngrad.train.loop import Hooks, TrainConfig, train
    from attngrad.train.optim import AdamWConfig

    kw = dict(task="reverse", model="llama", batch_size=4, symbols=5, min_len=3, max_len=4, dim=8,
              heads=2, kv_heads=1, ffn=12, layers=1, qk_norm="rms", tie_embeddings=True,
              optim=AdamWConfig(warmup=2), eval_every=6, eval_size=4, ckpt_every=3, seed=1)
    quiet = dict(progress=False, plots=False, log=lambda *a: None)
    cfg = TrainConfig(steps=6, **kw)
    full = train(cfg, tmp_path / "a", **quiet)

    class Stop(Exception):
        pass

    def stop_at_4(step):  # a crash after step 4: the checkpoint of step 3 is the newest
        if step == 4:
            raise Stop

    with pytest.raises(Stop):
        train(cfg, tmp_path / "b", hooks=Hooks(after_step=stop_at_4), **quiet)
    resumed = train(cfg, tmp_path / "b", resume="latest", **quiet)
    assert full.params.keys() == resumed.params.keys()
    for k, v in full.params.items():
        assert v.tobytes() == resumed.params[k].tobytes(), k
