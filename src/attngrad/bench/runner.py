"""``attngrad bench`` as a library call: time and measure every contender on every case."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

import numpy as np

from ..core.parallel import available_cores
from .contenders import ATTENTION, REFERENCE, Case, contender, library
from .memory import measure
from .timing import summarize, time_round_robin


@dataclass(frozen=True)
class BenchConfig:
    sizes: tuple = (1024, 4096)  # N
    causal: tuple = (False, True)
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    threads: int | None = None  # None = every core
    block_q: int | None = None
    block_k: int | None = None
    rounds: int = 5
    warmup: int = 1
    settle: float = 0.15
    contenders: tuple = tuple(ATTENTION)
    memory: bool = True
    timing: bool = True  # False: memory only (e.g. a sweep to large N)
    memory_max_dense_n: int = 4096  # contenders that keep (N x N) are measured up to here
    layer: bool = True  # also the multi-head layer against torch.nn.MultiheadAttention
    layer_shape: tuple = (4, 256, 512, 8)  # B, N, E, H
    layer_contenders: tuple = ("torch_mha", "attngrad_mha")
    seed: int = 0

    def __post_init__(self):
        for name in ("batch", "heads", "head_dim", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if not self.sizes or any(not isinstance(n, int) or n < 1 for n in self.sizes):
            raise ValueError(f"sizes must be positive integers; got {self.sizes!r}")
        if len(self.layer_shape) != 4 or self.layer_shape[2] % self.layer_shape[3]:
            raise ValueError(f"layer_shape must be (B, N, E, H) with H dividing E; got {self.layer_shape!r}")
        if not self.settle >= 0:
            raise ValueError(f"settle must be >= 0 seconds; got {self.settle!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}")
        for name in self.contenders:
            contender("attention", name)
        for name in self.layer_contenders:
            contender("layer", name)


@dataclass
class BenchResult:
    config: BenchConfig
    rows: list = field(default_factory=list)  # one dict per (case, contender)
    environment: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.config.__dict__.items()}
        return {"config": cfg, "environment": self.environment, "rows": self.rows}


def _environment(threads: int) -> dict:
    env = {"numpy": np.__version__, "python": platform.python_version(), "threads": threads,
           "cores": available_cores(), "machine": platform.machine()}
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - torch is optional
        env["torch"] = None
    if hasattr(os, "getloadavg"):
        env["loadavg_start"] = os.getloadavg()[0]
    return env


def _keeps_nxn(name: str) -> bool:
    return name in ("torch_naive", "attngrad_dense", "attngrad_mha_dense")


def _run_cases(result: BenchResult, cases: list, names: tuple, cfg: BenchConfig) -> None:
    for case in cases:
        times = {}
        if cfg.timing:
            steps = {name: contender(case.kind, name)(case) for name in names}
            times = time_round_robin(steps, rounds=cfg.rounds, warmup=cfg.warmup, settle=cfg.settle)
            del steps
        ref = REFERENCE[case.kind]
        for name in names:
            row = {"kind": case.kind, "n": case.n, "causal": case.causal, "batch": case.batch,
                   "heads": case.heads, "dim": case.d, "contender": name}
            if name in times:
                row.update(summarize(times[name]))
                row["gflops"] = case.flops() / row["median_s"] / 1e9
            if ref in times:
                row["vs_reference"] = row["median_s"] / float(np.median(times[ref]))
            if cfg.memory and (case.n <= cfg.memory_max_dense_n or not _keeps_nxn(name)):
                row.update(measure(case, name))
            result.rows.append(row)


def run_bench(cfg: BenchConfig) -> BenchResult:
    """Time (round robin, medians) and measure (fresh processes) every contender."""
    threads = cfg.threads or available_cores()
    result = BenchResult(cfg, environment=_environment(threads))
    if any(library(n) == "torch" for n in cfg.contenders + cfg.layer_contenders):
        import torch

        torch.set_num_threads(threads)
    cases = [Case(cfg.batch, cfg.heads, n, cfg.head_dim, cfg.dtype, c, "attention", cfg.block_q,
                  cfg.block_k, cfg.threads, cfg.seed) for n in cfg.sizes for c in cfg.causal]
    _run_cases(result, cases, cfg.contenders, cfg)
    if cfg.layer:
        b, n, e, h = cfg.layer_shape
        layer = Case(b, h, n, e, cfg.dtype, False, "layer", cfg.block_q, cfg.block_k, cfg.threads, cfg.seed)
        _run_cases(result, [layer], cfg.layer_contenders, cfg)
    if hasattr(os, "getloadavg"):
        result.environment["loadavg_end"] = os.getloadavg()[0]
    return result


def format_bench(result: BenchResult) -> str:
    """A plain-text table (Markdown-compatible)."""
    env, cfg = result.environment, result.config
    lines = [
        f"attngrad bench: {cfg.dtype}, {env['threads']} threads ({env['cores']} cores), "
        f"median of {cfg.rounds} round-robin rounds; numpy {env['numpy']}, torch {env.get('torch')}; "
        f"load average {env.get('loadavg_start', float('nan')):.2f} -> {env.get('loadavg_end', float('nan')):.2f}",
        "",
        "| shape | causal | contender | median ms | spread | GFLOP/s | peak extra MB | time vs ref |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result.rows:
        shape = (f"B={r['batch']} H={r['heads']} N={r['n']} D={r['dim']}" if r["kind"] == "attention"
                 else f"layer B={r['batch']} N={r['n']} E={r['dim']} H={r['heads']}")
        mem = r.get("peak_extra_bytes")
        mem_s = f"{mem / 2**20:.1f}" if mem is not None else "-"
        ratio = r.get("vs_reference")
        ms, spread, gf = (
            (f"{r['median_s'] * 1e3:.1f}", f"{r['spread']:.0%}", f"{r['gflops']:.1f}")
            if "median_s" in r else ("-", "-", "-")
        )
        lines.append(
            f"| {shape} | {'yes' if r['causal'] else 'no'} | {r['contender']} | {ms} | {spread} | "
            f"{gf} | {mem_s} | {f'{ratio:.2f}x' if ratio else '-'} |"
        )
    lines.append("")
    lines.append("ref = torch_sdpa (attention), torch_mha (layer); spread = (max - min) / median; "
                 "GFLOP/s = 12 N^2 D per head (halved for causal) / median time")
    return "\n".join(lines)
