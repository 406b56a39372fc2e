"""``attngrad export``: a GPT-2 or Llama-family run as a Hugging Face directory."""

from __future__ import annotations

import sys
from pathlib import Path

from ..train.pretrained import export_run


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a --model gpt2 or llama run as a Hugging Face directory (config.json + model.safetensors)",
        description=(
            "Write the newest checkpoint of a --model gpt2 or --model llama run (verified, never "
            "unpickled) as a directory transformers loads with from_pretrained (GPT2LMHeadModel, "
            "LlamaForCausalLM, or the --init-from model's own class: Qwen2, Qwen3, Mistral), with the "
            "same logits. A run started --init-from a Hugging Face model writes that model's config.json "
            "back as it was (positions, special token ids, dropouts, RoPE settings; the dtype excepted) "
            "with its tokenizer and generation_config.json; a run from scratch gets a config made from "
            "its model, attngrad's special ids (pad 0, bos 1, eos 2) and its tokenizer.json. A "
            "generation_config.json always. The files go to a temporary folder renamed to OUTDIR when "
            "complete. Needs attngrad[hf]."
        ),
    )
    p.add_argument("--run", type=Path, required=True, metavar="DIR", help="the run folder (attngrad train --out)")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="OUTDIR",
                   help="the directory to write (must not exist, or be empty)")
    p.add_argument("--checkpoint", type=Path, default=None, metavar="CKPT",
                   help="a checkpoint file to export instead of the newest in DIR")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of the written weights (default float32)")
    p.set_defaults(func=run)


def run(args) -> int:
    out = export_run(args.run, args.out, checkpoint=args.checkpoint, dtype=args.dtype)
    names = ", ".join(sorted(f.name for f in out.iterdir()))
    print(f"attngrad export: {args.run} -> {out} ({names})")
    sys.stdout.flush()
    return 0
