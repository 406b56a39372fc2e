"""Named sets of ``attngrad train`` options (``--preset NAME``): the command line and a
``--config FILE.toml`` override them.  Keys are the options' names with underscores."""

from __future__ import annotations

# nanoGPT's shakespeare_char recipe scaled to a CPU: 4 layers of width 128 and 4 heads
# (nanoGPT: 6 x 384 x 6), context 128 (nanoGPT: 256), AdamW lr 1e-3 with beta2 0.99 and
# 100 warmup steps, as there.
PRESETS = {
    "char": {
        "layers": 4, "dim": 128, "heads": 4, "ffn": 512, "context": 128,
        "batch_size": 32, "steps": 2000, "lr": 1e-3, "beta2": 0.99, "warmup": 100,
        "min_lr_ratio": 0.1, "weight_decay": 0.1, "eval_every": 250, "eval_size": 64,
        "ckpt_every": 250,
    },
}


def preset(name: str) -> dict:
    """The options of preset ``name`` (ValueError naming the known ones otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return dict(PRESETS[name])
