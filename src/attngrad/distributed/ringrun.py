"""One ring-attention run on synthetic inputs, as ``attngrad ring`` does it: every rank
makes its own shard of the inputs (chunk by chunk, from the seed, so no rank ever holds
the whole sequence), runs forward and backward, and reports time, peak memory and bytes
sent; the launcher compares the gathered shards with one process's closed form.
"""

from __future__ import annotations

import json
import math
import resource
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .layout import check_layout, check_length, chunk_ids, chunks_per_rank, unshard

# Each input is drawn chunk by chunk from default_rng([seed, stream, chunk]).
_STREAMS = {"q": 1, "k": 2, "v": 3, "dout": 4}


@dataclass(frozen=True)
class RingRunConfig:
    length: int  # N, the global sequence length (queries and keys)
    nproc: int  # P
    batch: int = 1  # B
    heads: int = 4  # H
    kv_heads: int = 0  # Hkv (0: = H)
    dim: int = 64  # D = Dv
    causal: bool = False
    layout: str = "zigzag"
    dtype: str = "float64"
    seed: int = 0

    def __post_init__(self):
        check_layout(self.layout)
        for name in ("length", "nproc", "batch", "heads", "dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}")
        if self.heads % self.hkv:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.hkv}")
        check_length(self.length, self.nproc, self.layout, name="--len")

    @property
    def hkv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def chunk(self) -> int:
        return self.length // (self.nproc * chunks_per_rank(self.layout))

    def heads_of(self, name: str) -> int:
        return self.hkv if name in ("k", "v") else self.heads

    def input_bytes(self) -> int:
        """Bytes of q, k, v and dOut for the whole sequence."""
        item = np.dtype(self.dtype).itemsize
        return item * self.batch * self.length * self.dim * 2 * (self.heads + self.hkv)

    def estimate_bytes(self, nproc: int) -> int:
        """Rough peak working memory of one of ``nproc`` ranks (inputs, outputs, gradients,
        ring buffers: about 4x the inputs' share), for refusing what cannot fit up front."""
        return 4 * self.input_bytes() // nproc


def make_chunk(cfg: RingRunConfig, name: str, cid: int) -> np.ndarray:
    rng = np.random.default_rng([cfg.seed, _STREAMS[name], cid])
    shape = (cfg.batch, cfg.heads_of(name), cfg.chunk, cfg.dim)
    return rng.standard_normal(shape).astype(cfg.dtype)  # (B, H|Hkv, c, D)


def make_shard(cfg: RingRunConfig, name: str, rank: int) -> np.ndarray:
    ids = chunk_ids(cfg.layout, rank, cfg.nproc)
    return np.concatenate([make_chunk(cfg, name, c) for c in ids], axis=2)


def make_full(cfg: RingRunConfig, name: str) -> np.ndarray:
    n = cfg.nproc * chunks_per_rank(cfg.layout)
    return np.concatenate([make_chunk(cfg, name, c) for c in range(n)], axis=2)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_rank(cfg: RingRunConfig, results: Path | None, *, timeout: float = 60.0, threads=None) -> dict:
    """This rank's part of the run (joins the group from the environment)."""
    from ..runtime.parallel import blas_threads
    from .launch import init_from_env, shutdown
    from .ring import ring_attention_backward, ring_attention_forward

    rank, world = init_from_env(timeout)
    if world != cfg.nproc:
        raise ValueError(f"WORLD_SIZE={world} but --nproc {cfg.nproc}")
    tracemalloc.start()
    q, k, v, do = (make_shard(cfg, n, rank) for n in ("q", "k", "v", "dout"))
    stats = {}
    with blas_threads(1):
        t0 = time.perf_counter()
        out, cache = ring_attention_forward(q, k, v, causal=cfg.causal, layout=cfg.layout,
                                            threads=threads, stats=stats)
        t1 = time.perf_counter()
        grads = ring_attention_backward(do, cache, stats=stats)
        t2 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rec = {"rank": rank, "forward_s": round(t1 - t0, 4), "backward_s": round(t2 - t1, 4),
           "peak_numpy_mb": round(peak / 2**20, 2), "peak_rss_mb": round(_peak_rss_mb(), 1),
           "bytes_sent": int(stats["bytes_sent"]), "messages": int(stats["messages"])}
    if results is not None:
        np.savez(results / f"rank{rank}.npz", out=out, dq=grads["q"], dk=grads["k"], dv=grads["v"])
        (results / f"rank{rank}.json").write_text(json.dumps(rec))
    shutdown()
    return rec


def run_reference(cfg: RingRunConfig, threads=None) -> tuple[dict, dict]:
    """One process, the whole sequence, the tiled closed form: (results, record)."""
    from ..core import sdpa_backward, sdpa_forward
    from ..runtime.parallel import blas_threads

    tracemalloc.start()
    q, k, v, do = (make_full(cfg, n) for n in ("q", "k", "v", "dout"))
    with blas_threads(1):
        t0 = time.perf_counter()
        out, cache = sdpa_forward(q, k, v, causal=cfg.causal, impl="tiled", threads=threads)
        t1 = time.perf_counter()
        g = sdpa_backward(do, cache)
        t2 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rec = {"forward_s": round(t1 - t0, 4), "backward_s": round(t2 - t1, 4),
           "peak_numpy_mb": round(peak / 2**20, 2)}
    return {"out": out, "dq": g["q"], "dk": g["k"], "dv": g["v"]}, rec


def gather(cfg: RingRunConfig, results: Path) -> tuple[dict, list[dict]]:
    """Every rank's shards joined into whole arrays, and the ranks' records."""
    shards = [dict(np.load(results / f"rank{r}.npz")) for r in range(cfg.nproc)]
    full = {n: unshard([s[n] for s in shards], cfg.layout) for n in ("out", "dq", "dk", "dv")}
    recs = [json.loads((results / f"rank{r}.json").read_text()) for r in range(cfg.nproc)]
    return full, recs


def max_rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref| (0 when both are 0)."""
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    diff = float(np.max(np.abs(a.astype(np.float64) - ref))) if ref.size else 0.0
    return diff / scale if scale else diff


def summary(cfg: RingRunConfig, recs: list[dict], errors: dict | None, ref: dict | None) -> dict:
    out = {"config": asdict(cfg), "ranks": recs}
    if ref is not None:
        out["one_process"] = ref
        peak = max(r["peak_numpy_mb"] for r in recs)
        out["peak_ratio"] = round(peak / ref["peak_numpy_mb"], 4) if ref["peak_numpy_mb"] else math.nan
    if errors is not None:
        out["max_rel_err"] = errors
    return out
