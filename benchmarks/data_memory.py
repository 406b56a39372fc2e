"""Peak memory of training data at scale: a corpus of --mb MB (a folder of .txt files of
random words, generated in --work, never committed) tokenized with ``attngrad tokenize``
and trained on for a few steps, from the shards and from the text folder directly.

Each command runs in a child process of its own; its peak resident memory is that
child's ``ru_maxrss`` (resource.getrusage(RUSAGE_CHILDREN) read by a one-command wrapper,
so the figures do not mix).  Issue 47's goal: under 1 GB for 100 MB.

    python benchmarks/data_memory.py --mb 100 --work /tmp/attngrad-data-memory
    python benchmarks/data_memory.py --mb 100 --bpe        # also a BPE fitted to the 90 MB training split
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("the lamplighter lit lamps along quay one by as tide came in at night harbour boats rope "
         "salt wind bell tower keeper light stone stairs sea gull fog morning").split()


def make_corpus(folder: Path, mb: float, files: int, seed: int = 0) -> int:
    """``files`` text files of about ``mb`` MB in all; returns the bytes written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per = int(mb * 1e6 / files)
    vocab = np.array([w + " " for w in WORDS] + [w + "\n" for w in WORDS[:6]] + ["é ", "naïve\n"])
    total = 0
    for i in range(files):
        with open(folder / f"part{i:03d}.txt", "w", encoding="utf-8") as f:
            written = 0
            while written < per:
                chunk = "".join(rng.choice(vocab, 20_000))
                f.write(chunk)
                written += len(chunk.encode())
        total += (folder / f"part{i:03d}.txt").stat().st_size
    return total


def measure(cmd: list) -> dict:
    """Run ``cmd`` in a wrapper process that reports its child's peak RSS."""
    wrapper = ("import resource, subprocess, sys, json, time; t = time.perf_counter(); "
               "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "print(json.dumps({'rc': r.returncode, 'seconds': time.perf_counter() - t, "
               "'maxrss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
               "'tail': (r.stdout + r.stderr)[-600:]}))")
    res = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=100.0, help="corpus size in MB (default 100)")
    ap.add_argument("--files", type=int, default=20, help="text files in the corpus (default 20)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/attngrad-data-memory"), help="scratch folder")
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ap.add_argument("--bpe", action="store_true", help="also tokenize with a BPE fitted to the training split")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    corpus = args.work / "corpus"
    t = time.perf_counter()
    size = make_corpus(corpus, args.mb, args.files)
    print(f"corpus: {size / 1e6:.1f} MB in {args.files} files ({time.perf_counter() - t:.1f} s to write)")
    attngrad = [sys.executable, "-m", "attngrad"]
    train = ["--model", "llama", "--dim", "64", "--heads", "4", "--ffn", "128", "--layers", "2", "--context", "128",
             "--batch-size", "16", "--steps", str(args.steps), "--eval-every", str(args.steps), "--eval-size", "16",
             "--warmup", "1", "--quiet", "--no-plots"]
    runs = [("tokenize (bytes)", [*attngrad, "tokenize", str(corpus), "-o", str(args.work / "shards")]),
            ("train on the shards", [*attngrad, "train", "--data", str(args.work / "shards"), *train,
                                     "--out", str(args.work / "run-shards")]),
            ("train on the text folder", [*attngrad, "train", "--data", str(corpus), *train,
                                          "--out", str(args.work / "run-text")])]
    if args.bpe:
        bpe = ["--tokenizer", "bpe", "--vocab-size", "4096"]
        runs += [("tokenize (BPE 4096, fitted)", [*attngrad, "tokenize", str(corpus), "-o",
                                                  str(args.work / "shards-bpe"), *bpe]),
                 ("train on the BPE shards", [*attngrad, "train", "--data", str(args.work / "shards-bpe"), *train,
                                              "--out", str(args.work / "run-shards-bpe")]),
                 ("train on the text folder, BPE", [*attngrad, "train", "--data", str(corpus), *train, *bpe,
                                                    "--out", str(args.work / "run-text-bpe")])]
    rows = []
    for name, cmd in runs:
        r = measure(cmd)
        rows.append({"what": name, **r})
        status = "ok" if r["rc"] == 0 else f"exit {r['rc']}: {r['tail']}"
        print(f"{name:32s} peak RSS {r['maxrss_kib'] / 1024:8.1f} MiB  {r['seconds']:7.1f} s  {status}")
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "bytes": size, "rows": rows}, indent=2))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
