"""A Hugging Face training step with attn_implementation="attngrad": torch.compile vs eager.

Two copies of one Qwen2 model built from a config (no download; grouped-query heads,
float32, CPU): one run as is, one through ``torch.compile(model, fullgraph=True)`` (a graph
break raises).  One step = forward, loss, backward, AdamW update, on a right-padded batch
(rows of decreasing length, attention_mask 0 and labels -100 at the pads), so every layer
gets transformers' boolean padding mask.  Each round draws a new padding pattern of the
same shapes (a compiled model that recompiled on new mask values would show it here) and
times both copies on it, in alternating order; the ratio compiled / eager is taken per
round, then the medians.  Warm-up steps first (the compiled copy's first one compiles; its
time is printed).  ``--impl sdpa`` runs the same comparison for transformers' sdpa.

    python benchmarks/hf_compile.py [--context 512] [--batch 4] [--layers 4] [--hidden 256]
        [--heads 8] [--kv-heads 2] [--window 0] [--rounds 10] [--warmup 3] [--impl attngrad]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.processor() or platform.machine()


def build(args, torch, transformers):
    """The model (dropout 0; a sliding window on every other layer with --window w > 0)."""
    layer_types = None
    if args.window:
        layer_types = ["sliding_attention", "full_attention"] * (args.layers // 2) + ["sliding_attention"] * (
            args.layers % 2)
    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.context, 64), pad_token_id=0, use_sliding_window=bool(args.window),
        sliding_window=args.window or None, layer_types=layer_types, max_window_layers=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation=args.impl).train()


def batch(args, rnd: int, torch):
    """Right-padded rows: row r keeps between half and all of the context (a new draw each round)."""
    g = torch.Generator().manual_seed(rnd)
    ids = torch.randint(1, args.vocab, (args.batch, args.context), generator=g)
    keep = torch.randint(args.context // 2, args.context + 1, (args.batch,), generator=g)
    keep[0] = args.context  # one full row: the batch keeps its length
    mask = (torch.arange(args.context)[None, :] < keep[:, None]).long()  # (B, L)
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--window", type=int, default=0, help="a sliding window on every other layer (0: none)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each copy first")
    ap.add_argument("--impl", default="attngrad", choices=["attngrad", "sdpa", "eager"])
    args = ap.parse_args()

    import torch
    import transformers

    import attngrad.transformers

    attngrad.transformers.register()
    load0 = os.getloadavg()
    eager = build(args, torch, transformers)
    twin = build(args, torch, transformers)
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, fullgraph=True)  # a graph break raises
    runs = {"eager": (eager, torch.optim.AdamW(eager.parameters(), lr=1e-4)),
            "compiled": (compiled, torch.optim.AdamW(twin.parameters(), lr=1e-4))}

    def step(name: str, inputs) -> tuple[float, float]:
        model, opt = runs[name]
        t0 = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item()

    first = {}
    for name in runs:
        first[name] = step(name, batch(args, -1, torch))  # the compiled copy compiles here
    losses_equal = abs(first["compiled"][1] - first["eager"][1]) <= 1e-5 * abs(first["eager"][1])
    for w in range(1, args.warmup):
        for name in runs:
            step(name, batch(args, -1 - w, torch))
    times = {name: [] for name in runs}
    ratios = []
    for rnd in range(args.rounds):
        inputs = batch(args, rnd, torch)
        order = ("eager", "compiled") if rnd % 2 == 0 else ("compiled", "eager")
        t = {name: step(name, inputs)[0] for name in order}
        for name in runs:
            times[name].append(t[name])
        ratios.append(t["compiled"] / t["eager"])
        print(f"round {rnd}: eager {t['eager'] * 1e3:.1f} ms, compiled {t['compiled'] * 1e3:.1f} ms, "
              f"ratio {ratios[-1]:.2f}")
    load1 = os.getloadavg()
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"one training step, attn_implementation={args.impl!r}, float32, B {args.batch} x L {args.context} "
          f"right-padded, {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}"
          f"{f', window {args.window}' if args.window else ''}; {args.rounds} rounds after {args.warmup} warm-up "
          f"steps; compile + first step {first['compiled'][0]:.1f} s (eager's first {first['eager'][0]:.2f} s); "
          f"first losses equal (1e-5): {losses_equal}")
    print(f"median eager {med['eager'] * 1e3:.1f} ms, compiled {med['compiled'] * 1e3:.1f} ms; "
          f"ratio compiled / eager median {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] "
          "(< 1: compiled faster)")
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; load average {load0[0]:.2f} before, {load1[0]:.2f} after")


if __name__ == "__main__":
    main()
