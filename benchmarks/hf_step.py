"""One training step of a tiny gpt-oss-style model: attn_implementation="attngrad" vs "eager".

A GptOss model built from a config (no download): sinks, alternating sliding-window and
full layers, grouped-query heads, float32, CPU.  One step = forward, loss, backward,
AdamW update, at a context where eager's (L x L) matrices matter (default 2048).
Round-robin rounds (ratio attngrad / eager per round, then medians); peak memory of each
implementation once in a fresh process (VmHWM above the resident set after building the
model and one warm-up step at a short context).

    python benchmarks/hf_step.py [--context 2048] [--rounds 3] [--layers 2] [--hidden 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time


def _model(impl: str, layers: int, hidden: int, heads: int, window: int):
    import torch
    import transformers

    import attngrad.transformers

    attngrad.transformers.register()
    cfg = transformers.GptOssConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=1 << 16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM._from_config(cfg, attn_implementation=impl, experts_implementation="eager")
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, context: int) -> float:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(context))
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _child(argv) -> None:
    impl, context, layers, hidden, heads, window = argv[0], *map(int, argv[1:])
    model, opt = _model(impl, layers, hidden, heads, window)
    _step(model, opt, min(context, 256))  # imports, compilation, optimizer state
    # the kernel's high-water mark over the resident set before the step, reset first
    # (/proc/self/clear_refs): ru_maxrss would carry the parent's peak across fork + exec
    from attngrad.bench.memory import _reset_peak, _status_kib

    gc.collect()
    base = _status_kib("VmRSS")
    _reset_peak()
    seconds = _step(model, opt, context)
    print(json.dumps({"peak_mb": (_status_kib("VmHWM") - base) / 1024, "seconds": seconds}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--window", type=int, default=128)
    args = ap.parse_args()
    dims = (args.layers, args.hidden, args.heads, args.window)
    print(f"load average before: {os.getloadavg()}")
    models = {impl: _model(impl, *dims) for impl in ("attngrad", "eager")}
    for model, opt in models.values():  # warm-up
        _step(model, opt, min(args.context, 256))
    times, ratios = {"attngrad": [], "eager": []}, []
    for r in range(args.rounds):
        order = ("attngrad", "eager") if r % 2 == 0 else ("eager", "attngrad")
        t = {impl: _step(*models[impl], args.context) for impl in order}
        for impl in t:
            times[impl].append(t[impl])
        ratios.append(t["attngrad"] / t["eager"])
        print(f"context {args.context} round {r}: attngrad {t['attngrad']:.3f} s, eager {t['eager']:.3f} s, "
              f"ratio {ratios[-1]:.2f}")
    peaks = {}
    for impl in ("attngrad", "eager"):
        cmd = [sys.executable, __file__, "--child", impl, str(args.context), *map(str, dims)]
        peaks[impl] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["peak_mb"]
    print(f"context {args.context}: median attngrad {statistics.median(times['attngrad']):.3f} s, eager "
          f"{statistics.median(times['eager']):.3f} s, median ratio {statistics.median(ratios):.2f}; peak MB "
          f"attngrad {peaks['attngrad']:.1f}, eager {peaks['eager']:.1f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
