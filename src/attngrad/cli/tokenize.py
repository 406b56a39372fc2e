"""``attngrad tokenize``: text into token shards, streaming, for ``attngrad train --data DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

from ..train.shards import tokenize
from .args import int_at_least, number_in


def register(sub) -> None:
    p = sub.add_parser(
        "tokenize",
        help="turn a text file or a folder of .txt files into token shards (train.bin, val.bin) for train --data",
        description=(
            "Read DATA (a UTF-8 file, or a folder of .txt files in path order, an end-of-document id "
            "between files) in pieces of 1 MB and write its token ids to OUTDIR as nanoGPT's prepare.py "
            "does: train.bin and val.bin, little-endian uint16 (uint32 past 65536 ids), the last "
            "--val-fraction of the bytes held out; beside them tokens.json (counts, tokenizer, checksums) "
            "and the tokenizer's tokenizer.json. Memory stays bounded by a piece, whatever the size of "
            "DATA. attngrad train --data OUTDIR reads the shards memory-mapped. The folder is written "
            "under a temporary name and renamed when complete."
        ),
    )
    p.add_argument("data", type=Path, metavar="DATA", help="a UTF-8 text file or a folder of .txt files")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="OUTDIR",
                   help="the shard folder to write (must not exist, or be empty)")
    p.add_argument("--tokenizer", default="bytes", metavar="KIND|PATH",
                   help="bytes (4 + 256 ids, the default), bpe (a byte-level BPE fitted to the training split; "
                        "needs attngrad[tok]), or a path: a tokenizer.json or a folder holding one (a Hugging "
                        "Face model to fine-tune --init-from, an attngrad run)")
    p.add_argument("--vocab-size", dest="vocab_size", type=int_at_least(260, 1 << 20), default=None, metavar="N",
                   help="--tokenizer bpe: vocabulary size (default 512)")
    p.add_argument("--val-fraction", dest="val_fraction", type=number_in(0.0, 1.0, hi_open=True), default=0.1,
                   metavar="F", help="the held-out tail of the bytes, in (0, 1) (default 0.1)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.val_fraction <= 0:
        raise ValueError(f"--val-fraction must be in (0, 1); got {args.val_fraction:g}")
    meta = tokenize(args.data, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                    val_fraction=args.val_fraction, log=lambda text: print(f"attngrad tokenize: {text}",
                                                                           file=sys.stderr))
    print(f"attngrad tokenize: {args.data} ({meta['files']} file{'s' if meta['files'] > 1 else ''}, "
          f"{meta['bytes']} bytes) -> {args.out}: {meta['train']['tokens']} training and {meta['val']['tokens']} "
          f"validation tokens ({meta['dtype']}, {meta['tokenizer']} tokenizer, {meta['vocab']} ids)")
    sys.stdout.flush()
    return 0
