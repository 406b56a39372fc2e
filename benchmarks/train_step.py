"""One training step (forward, loss, backward, clipping, AdamW) of attngrad's pure-NumPy
encoder-decoder against the same model in PyTorch eager on CPU.

PyTorch side: ``torch.nn.Transformer(norm_first=True)`` (pre-LN, like attngrad's blocks)
with the same sizes, embeddings x sqrt(E) + sinusoidal positions, an output projection,
``cross_entropy(ignore_index=PAD)``, ``clip_grad_norm_`` and ``torch.optim.AdamW``.
Round-robin timing (one step of each, repeated), medians, ratio = attngrad / PyTorch.

    OMP_NUM_THREADS=1 python benchmarks/train_step.py [--repeats 30] [--threads 1] [--dtype float32]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="BLAS / torch threads (default 1)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import numpy as np
    import torch
    from threadpoolctl import threadpool_limits

    from attngrad.models import MODELS
    from attngrad.train import data as D
    from attngrad.train.loop import TrainConfig, train_step
    from attngrad.train.optim import adamw_init, lr_at

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(dtype=args.dtype)  # the defaults of `attngrad train`
    batch = D.BatchStream(cfg.task_config, "encdec", cfg.batch_size, 0).next()
    params = MODELS["encdec"].init(cfg.model_config, 0)
    opt = adamw_init(params)

    tdt = getattr(torch, args.dtype)
    V, E = cfg.model_config.vocab, cfg.dim
    model = torch.nn.ModuleDict({
        "src": torch.nn.Embedding(V, E), "tgt": torch.nn.Embedding(V, E),
        "tr": torch.nn.Transformer(d_model=E, nhead=cfg.heads, num_encoder_layers=cfg.layers,
                                   num_decoder_layers=cfg.layers, dim_feedforward=cfg.ffn, dropout=0.0,
                                   batch_first=True, norm_first=True),
        "out": torch.nn.Linear(E, V),
    }).to(tdt)
    topt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.98), eps=1e-9,
                             weight_decay=cfg.optim.weight_decay)
    src, tin, tout = (torch.from_numpy(batch[k]) for k in ("src", "tgt_in", "tgt_out"))
    src_pad = src == D.PAD
    causal = torch.nn.Transformer.generate_square_subsequent_mask(tin.shape[1], dtype=tdt)

    def pe(length):
        pos = torch.arange(length, dtype=tdt)[:, None]
        div = torch.pow(10000.0, torch.arange(0, E, 2, dtype=tdt) / E)
        t = torch.zeros(length, E, dtype=tdt)
        t[:, 0::2], t[:, 1::2] = torch.sin(pos / div), torch.cos(pos / div)
        return t

    pe_s, pe_t = pe(src.shape[1]), pe(tin.shape[1])

    def torch_step(step):
        topt.zero_grad(set_to_none=True)
        x = model["src"](src) * math.sqrt(E) + pe_s
        y = model["tgt"](tin) * math.sqrt(E) + pe_t
        h = model["tr"](x, y, tgt_mask=causal, src_key_padding_mask=src_pad,
                        memory_key_padding_mask=src_pad, tgt_is_causal=True)
        logits = model["out"](h)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tout.reshape(-1), ignore_index=D.PAD)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
        for g in topt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg.optim)
        topt.step()
        return loss.item()

    state = {"p": params, "o": opt}

    def numpy_step(step):
        state["p"], state["o"], rec = train_step(state["p"], state["o"], batch, cfg, step)
        return rec["loss"]

    times = {"attngrad": [], "torch": []}
    with threadpool_limits(args.threads):
        for i in range(args.warmup + args.repeats):
            for name, fn in (("attngrad", numpy_step), ("torch", torch_step)):
                t0 = time.perf_counter()
                fn(i + 1)
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_np = sum(v.size for v in state["p"].values())
    n_t = sum(p.numel() for p in model.parameters())
    print(f"one training step, encdec defaults (B={cfg.batch_size}, Ls={src.shape[1]}, Lt={tin.shape[1]}, "
          f"E={E}, H={cfg.heads}, {cfg.layers}+{cfg.layers} layers, F={cfg.ffn}, V={V}), {args.dtype}, "
          f"{args.threads} thread(s), {platform.processor() or platform.machine()}")
    print(f"parameters: attngrad {n_np}, torch {n_t} (torch also has b_k and a final encoder/decoder norm each)")
    for k, v in med.items():
        print(f"  {k:>9}: median {v * 1e3:7.2f} ms  (min {min(times[k]) * 1e3:.2f}, max {max(times[k]) * 1e3:.2f}, "
              f"n={len(times[k])})")
    print(f"  ratio attngrad / torch eager: {med['attngrad'] / med['torch']:.2f}x  (goal <= 1.0x)")
    print(f"numpy {np.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
