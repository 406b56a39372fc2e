"""``attngrad bench`` as a library call: time and measure every contender on every case."""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass, field

import numpy as np

from ..core.tiled import AUTO_TILED_MIN_ENTRIES  # impl="auto" keeps P below this many logits
from ..resources import format_seconds, require_memory, require_time
from ..runtime.parallel import available_cores, check_threads
from ..runtime.threads import get_num_threads
from .contenders import ATTENTION, REFERENCE, Case, contender, library, primer
from .memory import measure
from .timing import paired_ratios, sgemm_rate, summarize, time_round_robin

MAX_SETTLE = 10.0  # seconds of idle before a timed call; more is a mistake, not a setting


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return value


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
    mixed: bool = False  # also time the contenders back to back, unsettled (reported beside)
    contenders: tuple = tuple(ATTENTION)
    memory: bool = True
    timing: bool = True  # False: memory only (e.g. a sweep to large N)
    memory_max_dense_n: int = 4096  # contenders that keep (N x N) are measured up to here
    layer: bool = True  # also the multi-head layer against torch.nn.MultiheadAttention
    layer_shape: tuple = (4, 256, 512, 8)  # B, N, E, H
    layer_contenders: tuple = ("torch_mha", "attngrad_mha")
    seed: int = 0

    def __post_init__(self):
        for name in ("batch", "heads", "head_dim", "rounds", "memory_max_dense_n"):
            _positive(name, getattr(self, name))
        for name in ("block_q", "block_k"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0; got {self.warmup!r}")
        if self.threads is not None:
            check_threads(self.threads)
        if not self.sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.sizes):
            raise ValueError(f"sizes must be positive integers; got {self.sizes!r}")
        if not self.causal or any(not isinstance(c, bool) for c in self.causal):
            raise ValueError(f"causal must be a non-empty tuple of booleans; got {self.causal!r}")
        shape = self.layer_shape
        if (len(shape) != 4 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape)
                or shape[2] % shape[3]):
            raise ValueError(f"layer_shape must be (B, N, E, H), positive, with H dividing E; got {shape!r}")
        if not (isinstance(self.settle, int | float) and 0 <= self.settle <= MAX_SETTLE):
            raise ValueError(f"settle must be a number of seconds in [0, {MAX_SETTLE:g}]; got {self.settle!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}")
        for name in self.contenders:
            contender("attention", name)
        if (self.block_q is not None or self.block_k is not None) and "attngrad_tiled" not in self.contenders:
            raise ValueError("block_q and block_k set the tiles of attngrad_tiled, which is not among the "
                             f"contenders {', '.join(self.contenders)}: they cannot apply")
        if not isinstance(self.mixed, bool):
            raise TypeError(f"mixed must be a bool; got {type(self.mixed).__name__}")
        if self.mixed and not self.timing:
            raise ValueError("mixed times the contenders back to back: it needs timing, which is off")
        if not (self.memory or self.timing):
            raise ValueError("memory and timing are both off: the benchmark would measure nothing")
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


def _run_cases(result: BenchResult, cases: list, names: tuple, cfg: BenchConfig, say) -> None:
    for case in cases:
        say(f"{case.kind} N={case.n}{' causal' if case.causal else ''}: {', '.join(names)}")
        times = {}
        if cfg.timing:
            steps = {name: contender(case.kind, name)(case) for name in names}
            times = time_round_robin(steps, rounds=cfg.rounds, warmup=cfg.warmup, settle=cfg.settle,
                                     primers={name: primer(name, case) for name in names})
            if cfg.mixed:
                mixed = time_round_robin(steps, rounds=cfg.rounds, warmup=cfg.warmup, mixed=True)
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
                if name != ref:
                    row.update(paired_ratios(times[name], times[ref]))
            if cfg.timing and cfg.mixed:
                row["mixed_median_s"] = float(np.median(mixed[name]))
                if ref in mixed and name != ref:
                    row["mixed_round_ratio_median"] = paired_ratios(mixed[name], mixed[ref])["round_ratio_median"]
            if cfg.memory and (case.n <= cfg.memory_max_dense_n or not _keeps_nxn(name)):
                row.update(measure(case, name))
            result.rows.append(row)


def selected(cfg: BenchConfig) -> tuple:
    """Every contender the run will build: the attention ones and, with the layer, the layer ones."""
    return cfg.contenders + (cfg.layer_contenders if cfg.layer else ())


def require_torch(cfg: BenchConfig) -> None:
    """ImportError naming the extra to install when a selected contender needs PyTorch."""
    need = [n for n in selected(cfg) if library(n) == "torch"]
    if need and importlib.util.find_spec("torch") is None:
        ours = ",".join(n for n in cfg.contenders if library(n) != "torch") or "attngrad_dense,attngrad_tiled"
        raise ImportError(
            f"the contenders {', '.join(need)} need PyTorch: pip install 'attngrad[torch]' "
            f"(or leave them out: --contenders {ours} --layer-contenders attngrad_mha)"
        )


def _cases(cfg: BenchConfig) -> tuple[list, Case | None]:
    cases = [Case(cfg.batch, cfg.heads, n, cfg.head_dim, cfg.dtype, c, "attention", cfg.block_q,
                  cfg.block_k, cfg.threads, cfg.seed) for n in cfg.sizes for c in cfg.causal]
    layer = None
    if cfg.layer:
        b, n, e, h = cfg.layer_shape
        layer = Case(b, h, n, e, cfg.dtype, False, "layer", cfg.block_q, cfg.block_k, cfg.threads, cfg.seed)
    return cases, layer




def _step_bytes(case: Case, name: str) -> tuple[float, float]:
    """(bytes of a contender's inputs, kept while every contender of the case is built;
    peak extra bytes of one forward + backward).  Rough, within a small factor."""
    item = np.dtype(case.dtype).itemsize
    b, h, n = case.batch, case.heads, case.n
    if case.kind == "layer":
        e = case.d
        inputs = (4 * e * e + 2 * b * n * e) * item
        dense = name == "attngrad_mha_dense" or (name in ("torch_mha", "attngrad_mha")
                                                 and b * h * n * n < AUTO_TILED_MIN_ENTRIES)
        peak = 12 * b * n * e * item + (4 * b * h * n * n * item if dense else 0)
        return inputs, peak
    inputs = 4 * b * h * n * case.d * item  # q, k, v, dO
    peak = 8 * b * h * n * case.d * item  # outputs, gradients, lse, tiles
    if _keeps_nxn(name):
        peak += 4 * b * h * n * n * item  # S, P, dP, dS
    return inputs, peak


FLOPS_PER_SECOND = 1e10  # a conservative rate for every contender (measured: 10-45 GFLOP/s)
TIME_LIMIT = 6 * 3600.0  # refuse runs estimated to take longer than this (seconds)


def estimate_seconds(cfg: BenchConfig) -> float:
    """Rough wall time: every timed call (warm-up and rounds) and every memory measurement."""
    cases, layer = _cases(cfg)
    calls = (cfg.rounds + cfg.warmup) * cfg.timing + cfg.memory
    total = 0.0
    for case, names in [(c, cfg.contenders) for c in cases] + ([(layer, cfg.layer_contenders)] if layer else []):
        total += len(names) * (calls * case.flops() / FLOPS_PER_SECOND + cfg.settle * calls * cfg.timing)
    return total


def estimate_memory(cfg: BenchConfig) -> float:
    """Rough peak bytes of the run: per case, every contender's inputs plus the largest step."""
    cases, layer = _cases(cfg)
    worst = 0.0
    for case, names in [(c, cfg.contenders) for c in cases] + ([(layer, cfg.layer_contenders)] if layer else []):
        sizes = [_step_bytes(case, name) for name in names]
        worst = max(worst, sum(i for i, _ in sizes) + max(p for _, p in sizes))
    return worst


def run_bench(cfg: BenchConfig, *, progress=None) -> BenchResult:
    """Time (round robin, medians) and measure (fresh processes) every contender.

    Refused before any work: a selected torch contender without PyTorch (ImportError
    naming the extra), a run whose estimated memory exceeds the machine's available
    memory or whose estimated time exceeds TIME_LIMIT (:class:`attngrad.resources.ResourceError`,
    a ValueError).  ``progress(text)``, if given, hears about each case."""
    require_torch(cfg)
    require_memory(estimate_memory(cfg), "this benchmark",
                   hint="use smaller --sizes, --batch, --heads or --head-dim, or leave out the "
                        "contenders that keep N x N (torch_naive, attngrad_dense)")
    seconds = estimate_seconds(cfg)
    require_time(seconds, TIME_LIMIT, "this benchmark", hint="use smaller --sizes or fewer --rounds")
    say = progress or (lambda text: None)
    say(f"estimated {format_seconds(seconds)}")
    threads = cfg.threads or get_num_threads()
    result = BenchResult(cfg, environment=_environment(threads))
    if any(library(n) == "torch" for n in selected(cfg)):
        import torch

        torch.set_num_threads(threads)
    if cfg.timing:
        n = 2048 if max(cfg.sizes) >= 1024 else 512  # (a smoke run's sizes: a smaller, quicker yardstick)
        result.environment["sgemm_n"] = n
        result.environment["sgemm_gflops"] = sgemm_rate(threads, n=n, torch_too=any(library(name) == "torch"
                                                                                  for name in selected(cfg)))
    cases, layer = _cases(cfg)
    _run_cases(result, cases, cfg.contenders, cfg, say)
    if layer is not None:
        _run_cases(result, [layer], cfg.layer_contenders, cfg, say)
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
        *(["SGEMM in this process: " + ", ".join(f"{k} {v:.0f}" for k, v in env["sgemm_gflops"].items())
           + f" GFLOP/s (float32, {env.get('sgemm_n', 2048)}^3)"] if env.get("sgemm_gflops") else []),
        "",
        "| shape | causal | contender | median ms | spread | GFLOP/s | peak extra MB | time vs ref "
        "| per round: median (quartiles) | faster rounds |" + (" mixed: median ms | mixed: per round |"
                                                              if cfg.mixed else ""),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if cfg.mixed else ""),
    ]
    peak = max(env.get("sgemm_gflops", {}).values(), default=0.0)
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
        if "median_s" in r and peak:
            gf += f" ({r['gflops'] / peak:.0%})"
        rounds = (f"{r['round_ratio_median']:.2f}x ({r['round_ratio_q1']:.2f}-{r['round_ratio_q3']:.2f})",
                  f"{r['rounds_faster']:.0%}") if "round_ratio_median" in r else ("-", "-")
        mixed = ""
        if cfg.mixed:
            m_ms, m_ratio = r.get("mixed_median_s"), r.get("mixed_round_ratio_median")
            mixed = (f" {'-' if m_ms is None else f'{m_ms * 1e3:.1f}'} |"
                     f" {'-' if m_ratio is None else f'{m_ratio:.2f}x'} |")
        lines.append(
            f"| {shape} | {'yes' if r['causal'] else 'no'} | {r['contender']} | {ms} | {spread} | "
            f"{gf} | {mem_s} | {f'{ratio:.2f}x' if ratio else '-'} | {rounds[0]} | {rounds[1]} |{mixed}"
        )
    lines.append("")
    lines.append("ref = torch_sdpa (attention), torch_mha (layer); spread = (max - min) / median; "
                 "GFLOP/s = 12 N^2 D per head (halved for causal) / median time, in brackets its share of "
                 "the best SGEMM rate above (a FlashAttention-style backward executes 14 N^2 D: 7/6 of "
                 "the share); time vs ref = the "
                 "ratio of the medians; per round = the contender's time over ref's in the same "
                 "round, so that the machine's drift between rounds cancels; faster rounds = the "
                 "share of rounds in which the contender beat ref"
                 + ("; mixed = the contenders timed again back to back, with no settling or priming "
                    "between them (as a script that calls one library right after the other)"
                    if cfg.mixed else ""))
    return "\n".join(lines)
