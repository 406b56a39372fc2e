"""``attngrad sample``: generate text from a run trained with ``attngrad train --data``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ..runtime.parallel import blas_threads
from ..train.kvcache import KV_MODELS
from ..train.sample import load_text_model, sample_text
from .args import int_at_least, number_in

MAX_TOKENS = 100_000


def register(sub) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a run trained with attngrad train --data",
        description=(
            "Load the newest checkpoint of a --data run (verified, never unpickled) and continue "
            "PROMPT token by token (bytes, or the run's BPE tokens from its tokenizer.json). "
            "Temperature 0 is greedy decoding (the most likely token each time); above 0, tokens "
            "are drawn from softmax(logits / T), restricted by --top-k and --top-p, reproducibly "
            "from --seed. The decoder and llama models keep a key/value cache (one position per "
            "new token while the window grows). Prints the prompt and its continuation; invalid "
            "UTF-8 in the output shows as U+FFFD."
        ),
    )
    p.add_argument("--run", type=Path, required=True, metavar="DIR", help="the run folder (attngrad train --out)")
    p.add_argument("--checkpoint", type=Path, default=None, metavar="CKPT",
                   help="a checkpoint file to use instead of the newest in DIR")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--tokens", type=int_at_least(0, MAX_TOKENS), default=200, metavar="N",
                   help="tokens (bytes with the byte tokenizer) to generate (default 200)")
    p.add_argument("--temperature", type=number_in(0.0, math.inf), default=0.8, metavar="T",
                   help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--top-k", dest="top_k", type=int_at_least(1), default=None, metavar="K",
                   help="draw from the K most likely tokens only (default: all)")
    p.add_argument("--top-p", dest="top_p", type=number_in(0.0, 1.0), default=None, metavar="P",
                   help="nucleus sampling: draw from the fewest most likely tokens whose probability "
                        "reaches P, in (0, 1] (default 1: all)")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="recompute the whole window for every token (as before the cache; slower)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.prompt:
        raise ValueError("--prompt must not be empty (the model continues at least one byte)")
    if args.top_p is not None and args.top_p <= 0:
        raise ValueError(f"--top-p must be in (0, 1]; got {args.top_p:g}")
    model = load_text_model(args.run, args.checkpoint)
    kv = args.kv_cache and model.cfg.model in KV_MODELS
    extra = "".join(f", {n} {v:g}" for n, v in (("top-k", args.top_k), ("top-p", args.top_p)) if v is not None)
    print(f"attngrad sample: {model.checkpoint} (step {model.step}), temperature {args.temperature:g}"
          f"{extra}, seed {args.seed}{', KV cache' if kv else ''}", file=sys.stderr)
    with blas_threads(1):  # one thread: the same tokens whatever the machine's BLAS does
        text = sample_text(model, args.prompt, args.tokens, temperature=args.temperature, seed=args.seed,
                           top_k=args.top_k, top_p=args.top_p, kv_cache=kv)
    sys.stdout.write(args.prompt + text + ("" if (args.prompt + text).endswith("\n") else "\n"))
    return 0
