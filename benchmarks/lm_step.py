"""One training step (forward, loss, backward, clipping, AdamW) of attngrad's decoder-only
and Llama-style language models against a PyTorch eager twin defined here, on CPU.

The twin has the same sizes and starts from the same weights (attngrad's initialisation
copied in), float32: decoder = x sqrt(E) + sinusoidal positions, pre-LN blocks (LN, MHA
with b_q b_v b_o, residual; LN, Linear, ReLU, Linear, residual), final LN, Linear head;
llama = embedding, RMSNorm, RoPE (rotate-half), grouped-query attention, SwiGLU, no biases.
Both use causal ``scaled_dot_product_attention``-equivalent maths, cross-entropy,
``clip_grad_norm_`` and AdamW (decay on matrices only, as attngrad), the learning rate of
attngrad's schedule at each step.  Each text batch is random windows of bytes.

The child runs attngrad as a library user's script does: no process-wide setting of
``attngrad train``'s (``--as-train`` keeps freed memory for reuse as ``attngrad train``
does, :func:`attngrad.runtime.allocator.retain_freed_memory`, glibc's malloc thresholds;
process-wide, so the PyTorch twin runs with it too).  Timing is round-robin (one step of
attngrad, one of PyTorch, repeated), each thread count in a fresh child process
(OMP/MKL/OpenBLAS threads set before NumPy and torch load, the child pinned to that many
CPUs, so that attngrad's default thread count, the CPUs it may run on, is that many);
reported per round: the ratio attngrad / PyTorch (median, min, max over rounds), and
tokens/s (B x T / median step time) of each, with the load average before and after.
Each timed step follows ``--settle`` untimed steps (default 1) of the same contender, as in
its own training loop; ``--settle 0`` is the *mixed* mode, the two steps back to back
as in a script that calls one library right after the other (PyTorch's OpenMP threads
spin for a while after its step).

    python benchmarks/lm_step.py                        # default and char sizes, 1 and 2 threads
    python benchmarks/lm_step.py --sizes tiny --threads 1 --repeats 3 --warmup 1   # a smoke run
    python benchmarks/lm_step.py --json out.json        # the rows as JSON too

Sizes: ``default`` = ``attngrad train --data`` defaults (E 64, H 4, F 128, 2 layers,
context 64, batch 64); ``char`` = ``--preset char`` (E 128, H 4, F 512, 4 layers, context
128, batch 32); ``char256`` = the preset at context 256; ``tiny`` for smoke runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

SIZES = {
    "tiny": dict(dim=16, heads=2, ffn=32, layers=1, context=16, batch_size=4),
    "default": dict(dim=64, heads=4, ffn=128, layers=2, context=64, batch_size=64),
    "char": dict(dim=128, heads=4, ffn=512, layers=4, context=128, batch_size=32),
    "char256": dict(dim=128, heads=4, ffn=512, layers=4, context=256, batch_size=16),
}
MODELS = ("decoder", "llama")


# ---------------------------------------------------------------- the PyTorch twins


def torch_twin(model: str, params: dict, mcfg, torch):
    """An nn.Module holding copies of attngrad's ``params`` and computing the same logits."""
    F = torch.nn.functional

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(torch.tensor(v.copy()))
                                             for k, v in params.items()})

        def w(self, name):
            return self.p[name.replace(".", "__")]

        def forward(self, ids):
            b, t = ids.shape
            return self.llama(ids, b, t) if model == "llama" else self.decoder(ids, b, t)

        def attend(self, q, k, v, heads, kv_heads):
            b, t, _ = q.shape
            q = q.view(b, t, heads, -1).transpose(1, 2)
            k = k.view(b, t, kv_heads, -1).transpose(1, 2)
            v = v.view(b, t, kv_heads, -1).transpose(1, 2)
            return q, k, v

        def decoder(self, ids, b, t):
            e, h = mcfg.dim, mcfg.heads
            x = self.w("emb.W")[ids] * math.sqrt(e) + self.pe[:t]
            for i in range(mcfg.dec_layers):
                p = f"dec.{i}."
                y = F.layer_norm(x, (e,), self.w(p + "ln1.g"), self.w(p + "ln1.b"), 1e-5)
                q = y @ self.w(p + "attn.W_q") + self.w(p + "attn.b_q")
                k = y @ self.w(p + "attn.W_k")
                v = y @ self.w(p + "attn.W_v") + self.w(p + "attn.b_v")
                q, k, v = self.attend(q, k, v, h, h)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, e)
                x = x + o @ self.w(p + "attn.W_o") + self.w(p + "attn.b_o")
                y = F.layer_norm(x, (e,), self.w(p + "ln2.g"), self.w(p + "ln2.b"), 1e-5)
                u = F.relu(y @ self.w(p + "ff1.W") + self.w(p + "ff1.b"))
                x = x + u @ self.w(p + "ff2.W") + self.w(p + "ff2.b")
            y = F.layer_norm(x, (e,), self.w("dec.ln.g"), self.w("dec.ln.b"), 1e-5)
            return y @ self.w("out.W") + self.w("out.b")

        def rope(self, x, t):
            half = x.shape[-1] // 2
            u, w = x[..., :half], x[..., half:]
            cos, sin = self.cos[:t], self.sin[:t]
            return torch.cat((u * cos - w * sin, w * cos + u * sin), dim=-1)

        def llama(self, ids, b, t):
            e, h, hkv = mcfg.dim, mcfg.heads, mcfg.num_kv_heads
            x = self.w("emb.W")[ids]
            for i in range(mcfg.layers):
                p = f"layers.{i}."
                y = F.rms_norm(x, (e,), self.w(p + "attn_norm.g"), mcfg.eps)
                q, k, v = self.attend(y @ self.w(p + "attn.W_q"), y @ self.w(p + "attn.W_k"),
                                      y @ self.w(p + "attn.W_v"), h, hkv)
                q, k = self.rope(q, t), self.rope(k, t)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
                x = x + o.transpose(1, 2).reshape(b, t, e) @ self.w(p + "attn.W_o")
                y = F.rms_norm(x, (e,), self.w(p + "ffn_norm.g"), mcfg.eps)
                z = F.silu(y @ self.w(p + "ffn.W_gate")) * (y @ self.w(p + "ffn.W_up"))
                x = x + z @ self.w(p + "ffn.W_down")
            y = F.rms_norm(x, (e,), self.w("norm.g"), mcfg.eps)
            return y @ (self.w("emb.W").T if mcfg.tie_embeddings else self.w("out.W"))

    twin = Twin()
    import numpy as np

    from attngrad.layers.positional import sinusoidal_table

    n = 4096
    twin.pe = torch.tensor(sinusoidal_table(n, mcfg.dim, "float32").copy())
    if model == "llama":
        d = mcfg.dim // mcfg.heads
        theta = mcfg.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        a = np.arange(n, dtype=np.float64)[:, None] * theta
        twin.cos, twin.sin = (torch.tensor(f(a).astype(np.float32)) for f in (np.cos, np.sin))
    return twin


# ---------------------------------------------------------------- one child: one thread count


def pin_cpus(n: int) -> list:
    """Run this process on ``n`` of its CPUs (where the OS has affinity masks), so that
    "n threads" holds for both sides: attngrad's attention workers count the CPUs of the
    affinity mask (``attngrad.runtime.parallel.available_cores``), not OMP_NUM_THREADS."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(cpus[:n]))
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return []


def run_child(args) -> list:
    cpus = pin_cpus(args.threads)  # before attngrad reads the core count
    import numpy as np
    import torch

    if args.as_train:
        from attngrad.runtime.allocator import retain_freed_memory

        retain_freed_memory()  # as ``attngrad train`` does (process-wide: the twin gets it too)

    from attngrad.models import MODELS as M
    from attngrad.train.config import TrainConfig
    from attngrad.train.loop import train_step
    from attngrad.train.optim import adamw_init, lr_at
    from attngrad.train.text import N_SPECIAL, VOCAB

    torch.set_num_threads(args.threads)
    rows = []
    text = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    for size in args.sizes:
        for model in args.models:
            cfg = TrainConfig.from_flat({"data": text, "model": model, **SIZES[size], "steps": 10_000, "warmup": 10})
            mcfg = cfg.model_config
            params = M[model].init(mcfg, 0)
            opt = adamw_init(params)
            twin = torch_twin(model, params, mcfg, torch)
            decay = [p for p in twin.parameters() if p.ndim >= 2]
            other = [p for p in twin.parameters() if p.ndim < 2]
            o = cfg.optim
            topt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": other, "weight_decay": 0.0}],
                                     lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
            rng = np.random.default_rng(0)
            b, t = cfg.batch_size, cfg.context
            win = rng.integers(N_SPECIAL, VOCAB, size=(b, t + 1))
            batch = {"inp": win[:, :-1], "tgt": win[:, 1:]}
            tin, tout = torch.from_numpy(batch["inp"]), torch.from_numpy(batch["tgt"])
            state = {"p": params, "o": opt}

            def ours(step, state=state, batch=batch, cfg=cfg):
                state["p"], state["o"], rec = train_step(state["p"], state["o"], batch, cfg, step)
                return rec["loss"]

            def theirs(step, twin=twin, topt=topt, cfg=cfg, tin=tin, tout=tout):
                topt.zero_grad(set_to_none=True)
                logits = twin(tin)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tout.reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(twin.parameters(), cfg.optim.clip)
                for g in topt.param_groups:
                    g["lr"] = lr_at(step, cfg.steps, cfg.optim)
                topt.step()
                return loss.item()

            l0 = (ours(1), theirs(1))  # same weights, same batch: the same first loss
            times = {"attngrad": [], "torch": []}
            nxt = {"attngrad": 2, "torch": 2}  # each contender's next step number (its learning rate)
            for i in range(args.warmup + args.repeats):
                for name, fn in (("attngrad", ours), ("torch", theirs)):
                    for _ in range(args.settle):  # the contender's own step first, as in its own loop
                        fn(nxt[name])
                        nxt[name] += 1
                    t0 = time.perf_counter()
                    fn(nxt[name])
                    dt = time.perf_counter() - t0
                    nxt[name] += 1
                    if i >= args.warmup:
                        times[name].append(dt)
            ratios = [a / b for a, b in zip(times["attngrad"], times["torch"], strict=True)]
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({
                "size": size, "model": model, "threads": args.threads, **SIZES[size],
                "first_loss": l0, "ms": {k: v * 1e3 for k, v in med.items()},
                "tokens_per_s": {k: b * t / v for k, v in med.items()},
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "rounds": len(ratios), "cpus": cpus,
            })
    return rows


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["default", "char"])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=20, help="timed rounds (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--settle", type=int, default=1,
                    help="untimed steps of a contender just before each of its timed steps (default 1)")
    ap.add_argument("--as-train", action="store_true",
                    help="keep freed memory for reuse in the child, as attngrad train does")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one thread count, in this process
        args.threads = args.threads[0]
        print(json.dumps(run_child(args)))
        return
    rows = []
    load0 = os.getloadavg()
    for n in args.threads:
        env = {**os.environ, **{k: str(n) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(n), "--sizes", *args.sizes,
               "--models", *args.models, "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--settle", str(args.settle), *(["--as-train"] if args.as_train else [])]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if res.returncode:
            sys.exit(f"child with {n} thread(s) failed:\n{res.stderr[-3000:]}")
        rows += json.loads(res.stdout.strip().splitlines()[-1])
    load1 = os.getloadavg()
    import numpy as np
    import torch

    print(f"one language-model training step, float32, attngrad / PyTorch eager twin, round-robin "
          f"({args.repeats} rounds after {args.warmup}, {args.settle} untimed step(s) before each timed one{'; as attngrad train' if args.as_train else ''}); {cpu_name()}, "
          f"{os.cpu_count()} CPUs; load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print(f"{'size':<8} {'model':<8} {'thr':>3} {'B x T':>9} {'attngrad ms':>11} {'torch ms':>9} "
          f"{'attngrad tok/s':>14} {'torch tok/s':>11} {'ratio med [min, max]':>22}")
    for r in rows:
        print(f"{r['size']:<8} {r['model']:<8} {r['threads']:>3} {r['batch_size']:>4}x{r['context']:<4} "
              f"{r['ms']['attngrad']:>11.2f} {r['ms']['torch']:>9.2f} {r['tokens_per_s']['attngrad']:>14,.0f} "
              f"{r['tokens_per_s']['torch']:>11,.0f} {r['ratio_median']:>8.2f}x [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}]")
    print("ratio = attngrad step time / PyTorch step time, per round (< 1: attngrad faster); "
          f"first losses equal: {all(abs(a - b) < 1e-4 * abs(b) for a, b in (r['first_loss'] for r in rows))}")
    print(f"numpy {np.__version__}, torch {torch.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load": [load0, load1]}, f, indent=1)


if __name__ == "__main__":
    main()
