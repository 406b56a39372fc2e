"""The GPT-2 preset (``--model gpt2``): the model's closed-form gradients against an
independent float64 PyTorch build (learned positions, pre-LN, every bias, tanh GELU, tied
or untied embeddings), central finite differences, and 20 AdamW training steps against
torch.optim.AdamW (rel <= 1e-9)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attngrad.layers.dropout import dropout_mask
from attngrad.models import MODELS
from attngrad.models.gpt2 import GPT2Config
from conftest import assert_close_rel, directional_check

torch = pytest.importorskip("torch")
F = torch.nn.functional


# ---------------------------------------------------------------- the PyTorch build (float64)


def t_ln(p, pre, x, eps):
    return F.layer_norm(x, (x.shape[-1],), p[pre + "g"], p[pre + "b"], eps=eps)


def t_gelu(x):  # GPT-2's gelu_new, written out
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def t_drop(x, p, seed, *site):
    if p == 0 or seed is None:
        return x
    keep = torch.from_numpy(dropout_mask(tuple(x.shape), p, (*seed, *site)))
    return x * keep / (1 - p)


def t_logits(p, cfg: GPT2Config, ids, seed=None):
    b, n = ids.shape
    e, h = cfg.dim, cfg.heads
    x = p["wte.W"][torch.from_numpy(ids)] + p["wpe.W"][:n]
    x = t_drop(x, cfg.dropout, seed, 0, 0)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg.layers):
        pre = f"h.{i}."
        a = t_ln(p, pre + "ln1.", x, cfg.eps)
        q, k, v = ((a @ p[pre + f"attn.W_{w}"] + p[pre + f"attn.b_{w}"]).view(b, n, h, -1).transpose(1, 2)
                   for w in "qkv")
        s = q @ k.transpose(-1, -2) / math.sqrt(e // h)
        att = torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1)
        o = (att @ v).transpose(1, 2).reshape(b, n, e) @ p[pre + "attn.W_o"] + p[pre + "attn.b_o"]
        x = x + t_drop(o, cfg.dropout, seed, 2, i, 1)
        f = t_gelu(t_ln(p, pre + "ln2.", x, cfg.eps) @ p[pre + "ff1.W"] + p[pre + "ff1.b"])
        x = x + t_drop(f @ p[pre + "ff2.W"] + p[pre + "ff2.b"], cfg.dropout, seed, 2, i, 2)
    hf = t_ln(p, "ln_f.", x, cfg.eps)
    return hf @ (p["wte.W"].T if cfg.tie_embeddings else p["out.W"])


def random_params(cfg, rng):
    """GPT-2's parameters with every entry random (biases and norm weights included)."""
    p = MODELS["gpt2"].init(cfg, 1)
    return {k: (1.0 if k.endswith(".g") else 0.0) + 0.3 * rng.standard_normal(v.shape) for k, v in p.items()}


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("tied", [True, False])
def test_model_gradients_match_torch_and_finite_differences(tied):
    cfg = GPT2Config(vocab=11, dim=8, heads=2, ffn=12, layers=2, positions=9, tie_embeddings=tied,
                     dtype="float64")
    rng = np.random.default_rng(3)
    p = random_params(cfg, rng)
    assert ("out.W" in p) is not tied and "h.0.attn.b_k" in p
    ids = rng.integers(0, 11, (3, 7))
    g = rng.standard_normal((3, 7, 11))
    model = MODELS["gpt2"]
    logits, cache = model.forward(p, cfg, ids)
    grads = model.backward(g, cache)
    assert grads.keys() == p.keys()
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    tl = t_logits(tp, cfg, ids)
    tl.backward(torch.tensor(g))
    ref = {"logits": tl.detach().numpy(), **{k: v.grad.numpy() for k, v in tp.items()}}
    assert_close_rel({"logits": logits, **grads}, ref)  # b_k: our exact 0 against torch's rounding noise
    scale = max(float(np.abs(r).max()) for r in ref.values())
    for i in range(cfg.layers):  # (GP4): torch's autograd agrees that db_k is zero up to rounding
        assert np.all(grads[f"h.{i}.attn.b_k"] == 0)
        assert np.abs(ref[f"h.{i}.attn.b_k"]).max() <= 1e-13 * scale
    assert np.all(grads["wpe.W"][7:] == 0)  # (GP3) positions past L
    maps = model.attention_maps(cache)["decoder_causal"]
    assert len(maps) == 2 and maps[0].shape == (3, 2, 7, 7)
    assert np.all(np.triu(maps[0][0, 0], 1) == 0)

    def loss_of(name):
        return lambda v: float(np.sum(model.forward({**p, name: v}, cfg, ids)[0] * g))

    for name in ("wte.W", "wpe.W", "h.0.attn.W_q", "h.0.attn.b_v", "h.1.ff1.b", "h.1.ln2.g", "ln_f.b",
                 *(["out.W"] if not tied else [])):
        directional_check(loss_of(name), p[name], grads[name], rng, n_dirs=2, what=name)


def test_float32_forward_and_errors():
    cfg = GPT2Config(vocab=7, dim=8, heads=2, ffn=8, layers=1, positions=4)
    p = MODELS["gpt2"].init(cfg, 0)
    logits, _ = MODELS["gpt2"].forward(p, cfg, np.zeros((1, 4), dtype=np.int64))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    with pytest.raises(ValueError, match="4 positions"):
        MODELS["gpt2"].forward(p, cfg, np.zeros((1, 5), dtype=np.int64))
    with pytest.raises(ValueError, match=r"ids must hold ids in \[0, 7\)"):
        MODELS["gpt2"].forward(p, cfg, np.full((1, 2), 7))
    for kwargs, words in ((dict(heads=3), "divide"), (dict(positions=0), "positions"),
                          (dict(eps=0.0), "eps"), (dict(dtype="float16"), "dtype"), (dict(dropout=1.0), "dropout|p ")):
        with pytest.raises((ValueError, TypeError), match=words):
            GPT2Config(vocab=7, **{"dim": 8, "heads": 2, **kwargs})


def test_train_config_gpt2():
    from attngrad.train.loop import TrainConfig

    cfg = TrainConfig(model="gpt2", min_len=3, max_len=6).model_config
    assert isinstance(cfg, GPT2Config) and cfg.positions == 15 and cfg.tie_embeddings
    with pytest.raises(ValueError, match="llama"):
        TrainConfig(model="gpt2", kv_heads=2)


# ---------------------------------------------------------------- 20 AdamW steps (the preset)


PARITY = {
    "plain": dict(dropout=0.0, label_smoothing=0.0),
    "dropout-smoothing": dict(dropout=0.1, label_smoothing=0.1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PARITY))
def test_twenty_adamw_steps_match_pytorch(case):
    from attngrad.train import data as D
    from attngrad.train.loop import TrainConfig, loss_and_grads, train_step
    from attngrad.train.optim import AdamWConfig, adamw_init, lr_at

    tol = 1e-9
    cfg = TrainConfig(task="reverse", model="gpt2", steps=20, batch_size=6, symbols=6, min_len=3,
                      max_len=6, dim=16, heads=4, ffn=24, layers=2, seed=7, dtype="float64",
                      optim=AdamWConfig(lr=3e-3, warmup=5, clip=0.5), **PARITY[case])
    mcfg = cfg.model_config
    params = MODELS["gpt2"].init(mcfg, cfg.seed)
    opt = adamw_init(params)
    # (GP4): b_k's gradient is exactly zero, so it never moves; torch's autograd would give
    # it rounding noise (checked small above), which AdamW's normalisation would amplify
    tp = {k: torch.tensor(v, requires_grad=".attn.b_k" not in k) for k, v in params.items()}
    learn = [k for k in params if tp[k].requires_grad]
    oc = cfg.optim
    groups = [
        {"params": [tp[k] for k in learn if params[k].ndim >= 2], "weight_decay": oc.weight_decay},
        {"params": [tp[k] for k in learn if params[k].ndim < 2], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False)
    stream = D.BatchStream(cfg.task_config, cfg.model, cfg.batch_size, cfg.seed)

    def rel(a, r):
        return float(np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-300))

    clipped = 0
    for step in range(1, cfg.steps + 1):
        batch = stream.next()
        seed = (cfg.seed, 3, step) if cfg.dropout > 0 else None
        loss, grads, _ = loss_and_grads(params, cfg, batch, seed)
        topt.zero_grad()
        logits = t_logits(tp, mcfg, batch["inp"], seed)
        tloss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(batch["tgt"]).reshape(-1),
                                ignore_index=D.PAD, label_smoothing=cfg.label_smoothing)
        tloss.backward()
        assert abs(loss - tloss.item()) <= tol * abs(tloss.item()), (step, loss, tloss.item())
        assert grads.keys() == tp.keys()
        for k in learn:
            assert rel(grads[k], tp[k].grad.numpy()) <= tol, (step, k, rel(grads[k], tp[k].grad.numpy()))
        params, opt, rec = train_step(params, opt, batch, cfg, step)
        norm = torch.nn.utils.clip_grad_norm_([tp[k] for k in learn], oc.clip)
        clipped += float(norm) > oc.clip
        assert abs(rec["grad_norm"] - float(norm)) <= tol * float(norm)
        for g in topt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, oc)
        topt.step()
        for k, v in params.items():
            assert rel(v, tp[k].detach().numpy()) <= tol if np.any(v) else np.all(tp[k].detach().numpy() == 0), (step, k)
    assert clipped > 0, "the clipping path was never exercised"
