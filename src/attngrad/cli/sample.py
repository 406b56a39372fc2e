"""``attngrad sample``: generate text from a run trained with ``attngrad train --data``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ..runtime.parallel import blas_threads
from ..train.sample import load_text_model, sample_text
from .args import int_at_least, number_in

MAX_TOKENS = 100_000








def register(sub) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a run trained with attngrad train --data",
        description=(
            "Load the newest checkpoint of a --data run (verified, never unpickled) and continue "
            "PROMPT byte by byte. Temperature 0 is greedy decoding (the most likely byte each "
            "time); above 0, bytes are drawn from softmax(logits / T), reproducibly from --seed. "
            "Prints the prompt and its continuation; invalid UTF-8 in the output shows as U+FFFD."
        ),
    )
    p.add_argument("--run", type=Path, required=True, metavar="DIR", help="the run folder (attngrad train --out)")
    p.add_argument("--checkpoint", type=Path, default=None, metavar="CKPT",
                   help="a checkpoint file to use instead of the newest in DIR")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--tokens", type=int_at_least(0, MAX_TOKENS), default=200, metavar="N", help="bytes to generate (default 200)")
    p.add_argument("--temperature", type=number_in(0.0, math.inf), default=0.8, metavar="T",
                   help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="S", help="random seed (default 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.prompt:
        raise ValueError("--prompt must not be empty (the model continues at least one byte)")
    model = load_text_model(args.run, args.checkpoint)
    print(f"attngrad sample: {model.checkpoint} (step {model.step}), temperature {args.temperature:g}, "
          f"seed {args.seed}", file=sys.stderr)
    with blas_threads(1):  # one thread: the same bytes whatever the machine's BLAS does
        text = sample_text(model, args.prompt, args.tokens, temperature=args.temperature, seed=args.seed)
    sys.stdout.write(args.prompt + text + ("" if (args.prompt + text).endswith("\n") else "\n"))
    return 0
