"""20 training steps of attngrad (pure NumPy, closed-form gradients) against the same
model written in PyTorch with autograd: same initial weights, same batches, same dropout
masks; losses, every parameter gradient and every updated parameter agree in float64."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from attngrad.layers.dropout import dropout_mask  # noqa: E402
from attngrad.models import MODELS  # noqa: E402
from attngrad.train import data as D  # noqa: E402
from attngrad.train.loop import TrainConfig, loss_and_grads, train_step  # noqa: E402
from attngrad.train.optim import AdamWConfig, adamw_init, lr_at  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out

TOL = 1e-9


def rel(a, r) -> float:
    a, r = np.asarray(a, dtype=np.float64), np.asarray(r, dtype=np.float64)
    return float(np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-300))


# ---------------------------------------------------------------- the PyTorch build


class TorchModel:
    """The same Transformer from torch ops; masks built here, independently."""

    def __init__(self, cfg: TrainConfig, params: dict):
        self.cfg = cfg
        self.p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}

    def drop(self, x, seed, *site):
        if self.cfg.dropout == 0 or seed is None:
            return x
        keep = torch.from_numpy(dropout_mask(tuple(x.shape), self.cfg.dropout, (*seed, *site)))
        return x * keep / (1 - self.cfg.dropout)

    def embed(self, name, ids, seed, site):
        E = self.cfg.dim
        x = self.p[name][torch.from_numpy(ids)] * math.sqrt(E)
        L = ids.shape[1]
        pos = torch.arange(L, dtype=torch.float64)[:, None]
        div = torch.pow(10000.0, torch.arange(0, E, 2, dtype=torch.float64) / E)
        pe = torch.zeros(L, E, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos / div)
        pe[:, 1::2] = torch.cos(pos / div)
        return self.drop(x + pe, seed, *site)

    def ln(self, pre, x):
        return F.layer_norm(x, (self.cfg.dim,), self.p[pre + "g"], self.p[pre + "b"], eps=1e-5)

    def lin(self, pre, x):
        return x @ self.p[pre + "W"] + self.p[pre + "b"]

    def mha(self, pre, x, mem=None, key_pad=None, causal=False):
        p, H = self.p, self.cfg.heads
        kv = x if mem is None else mem
        B, Lq, E = x.shape
        Lk = kv.shape[1]
        q = (x @ p[pre + "W_q"] + p[pre + "b_q"]).view(B, Lq, H, -1).transpose(1, 2)
        k = (kv @ p[pre + "W_k"]).view(B, Lk, H, -1).transpose(1, 2)
        v = (kv @ p[pre + "W_v"] + p[pre + "b_v"]).view(B, Lk, H, -1).transpose(1, 2)
        allowed = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        if key_pad is not None:  # torch-side convention: True = padding
            allowed = allowed & ~key_pad[:, None, None, :]
        if causal:
            allowed = allowed & torch.ones(Lq, Lk, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return o.transpose(1, 2).reshape(B, Lq, E) @ p[pre + "W_o"] + p[pre + "b_o"]

    def ffn(self, pre, x, ln):
        h = self.lin(pre + "ff1.", self.ln(pre + ln, x))
        h = F.relu(h) if self.cfg.activation == "relu" else F.gelu(h, approximate="tanh")
        return self.lin(pre + "ff2.", h)

    def logits(self, batch, seed):
        cfg = self.cfg
        if cfg.model == "encdec":
            src = batch["src"]
            pad = torch.from_numpy(src == D.PAD)
            x = self.embed("src_emb.W", src, seed, (0, 0))
            for i in range(cfg.layers):
                pre = f"enc.{i}."
                x = x + self.drop(self.mha(pre + "attn.", self.ln(pre + "ln1.", x), key_pad=pad), seed, 1, i, 1)
                x = x + self.drop(self.ffn(pre, x, "ln2."), seed, 1, i, 2)
            m = self.ln("enc.ln.", x)
            y = self.embed("tgt_emb.W", batch["tgt_in"], seed, (0, 1))
            for i in range(cfg.layers):
                pre = f"dec.{i}."
                y = y + self.drop(self.mha(pre + "self_attn.", self.ln(pre + "ln1.", y), causal=True), seed, 2, i, 1)
                y = y + self.drop(self.mha(pre + "cross_attn.", self.ln(pre + "ln2.", y), m, key_pad=pad), seed, 2, i, 2)
                y = y + self.drop(self.ffn(pre, y, "ln3."), seed, 2, i, 3)
        else:
            y = self.embed("emb.W", batch["inp"], seed, (0, 0))
            for i in range(cfg.layers):
                pre = f"dec.{i}."
                y = y + self.drop(self.mha(pre + "attn.", self.ln(pre + "ln1.", y), causal=True), seed, 2, i, 1)
                y = y + self.drop(self.ffn(pre, y, "ln2."), seed, 2, i, 2)
        return self.lin("out.", self.ln("dec.ln.", y))

    def loss(self, batch, seed):
        logits = self.logits(batch, seed)
        tgt = batch["tgt_out"] if self.cfg.model == "encdec" else batch["tgt"]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(tgt).reshape(-1),
                               ignore_index=D.PAD, label_smoothing=self.cfg.label_smoothing)


# ---------------------------------------------------------------- the test


CASES = {
    "encdec-relu": dict(model="encdec", activation="relu", dropout=0.0, label_smoothing=0.0),
    "encdec-gelu-dropout-smoothing": dict(model="encdec", activation="gelu", dropout=0.1, label_smoothing=0.1),
    "decoder-gelu": dict(model="decoder", activation="gelu", dropout=0.0, label_smoothing=0.0),
    "decoder-relu-dropout-smoothing": dict(model="decoder", activation="relu", dropout=0.2, label_smoothing=0.1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_twenty_steps_match_pytorch(case):
    cfg = TrainConfig(task="reverse", steps=20, batch_size=6, symbols=6, min_len=3, max_len=6, dim=16,
                      heads=2, ffn=24, layers=2, optim=AdamWConfig(lr=3e-3, warmup=5, clip=0.5), seed=7,
                      dtype="float64",
                      **CASES[case])
    params = MODELS[cfg.model].init(cfg.model_config, cfg.seed)
    opt = adamw_init(params)
    tm = TorchModel(cfg, params)
    oc = cfg.optim
    groups = [
        {"params": [tm.p[k] for k in params if params[k].ndim >= 2], "weight_decay": oc.weight_decay},
        {"params": [tm.p[k] for k in params if params[k].ndim < 2], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False)
    stream = D.BatchStream(cfg.task_config, cfg.model, cfg.batch_size, cfg.seed)
    clipped = 0
    for step in range(1, cfg.steps + 1):
        batch = stream.next()
        seed = (cfg.seed, 3, step) if cfg.dropout > 0 else None
        loss, grads, _ = loss_and_grads(params, cfg, batch, seed)
        topt.zero_grad()
        tloss = tm.loss(batch, seed)
        tloss.backward()
        assert abs(loss - tloss.item()) <= TOL * abs(tloss.item()), (step, loss, tloss.item())
        assert grads.keys() == tm.p.keys()
        for k, g in grads.items():
            ref = tm.p[k].grad.numpy()
            assert rel(g, ref) <= TOL, (step, k, rel(g, ref))
        params, opt, rec = train_step(params, opt, batch, cfg, step)
        assert rec["loss"] == loss
        norm = torch.nn.utils.clip_grad_norm_(list(tm.p.values()), oc.clip)
        clipped += float(norm) > oc.clip
        assert abs(rec["grad_norm"] - float(norm)) <= TOL * float(norm)
        for g in topt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, oc)
        topt.step()
        for k, v in params.items():
            assert rel(v, tm.p[k].detach().numpy()) <= TOL, (step, k)
    assert clipped > 0, "the clipping path was never exercised"
    assert opt["t"] == cfg.steps


def test_schedule_warmup_then_cosine_to_floor():
    cfg = AdamWConfig(lr=1e-2, warmup=10, min_lr_ratio=0.1)
    assert lr_at(1, 110, cfg) == pytest.approx(1e-3)
    assert lr_at(10, 110, cfg) == pytest.approx(1e-2)
    assert lr_at(60, 110, cfg) == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))
    assert lr_at(110, 110, cfg) == pytest.approx(1e-3)
    lrs = [lr_at(s, 110, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
