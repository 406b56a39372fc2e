"""Ring attention on real processes (torch.distributed, gloo, 127.0.0.1) equals one process.

Each world size P = 1..4 is one group of P spawned processes (this file run as a script)
that computes every case below; the test process compares the gathered shards with the
single-process closed form (``attngrad.sdpa_forward/backward``, dense, float64) at
max relative error <= 1e-12.  Errors: every rank raises (none waits forever), a dead peer
gives a clear error, and the command line refuses what cannot run with one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LAYOUTS = ("contiguous", "zigzag")
KINDS = ("mha", "gqa_pad", "lengths", "variants", "cross", "f32")
CAUSAL = {"mha": True, "gqa_pad": "top_left", "lengths": "bottom_right", "variants": True, "f32": True}
CASES = [(lay, c, kind) for lay in LAYOUTS for c in (False, True) for kind in KINDS[:4]]
CASES += [(lay, False, "cross") for lay in LAYOUTS]  # Lq != Lk
CASES += [("zigzag", True, "f32"), ("contiguous", False, "f32")]  # float32 shards
REL = 1e-12
GLOO_TIMEOUT = 30.0


def problem(world: int, layout: str, causal: bool, kind: str):
    """Whole-sequence inputs and options of one case (deterministic)."""
    rng = np.random.default_rng([world, LAYOUTS.index(layout), int(causal), KINDS.index(kind)])
    b, h, d, dv = 2, 4, 5, 3
    hkv = 2 if kind in ("gqa_pad", "variants") else h
    lq = 6 * world
    lk = 4 * world if kind == "cross" else lq
    arrays = {
        "q": rng.standard_normal((b, h, lq, d)),
        "k": rng.standard_normal((b, hkv, lk, d)),
        "v": rng.standard_normal((b, hkv, lk, dv)),
        "dout": rng.standard_normal((b, h, lq, dv)),
    }
    if kind == "f32":
        arrays = {n: a.astype(np.float32) for n, a in arrays.items()}
    opts = {}
    if causal:
        opts["causal"] = CAUSAL[kind]
    if kind in ("gqa_pad", "variants"):
        km = rng.random((b, lk)) < 0.7
        km[-1] = False if kind == "gqa_pad" else km[-1]  # a batch row with no key at all
        opts["key_mask"] = km
    if kind == "lengths":
        opts["key_lengths"] = np.array([int(rng.integers(1, lk)), 0])
    if kind == "variants":
        opts["sinks"] = rng.standard_normal(h)
        opts["softcap"] = 2.5
        seg = np.sort(rng.integers(0, 3, size=(b, lq)), axis=1)  # packed documents
        opts["q_segment_ids"] = seg
        opts["kv_segment_ids"] = seg.copy()
    return arrays, opts


SHARDED = {"key_mask", "q_segment_ids", "kv_segment_ids"}  # (B, L): sharded along axis 1


# ---------------------------------------------------------------- the spawned ranks


def _worker(outdir: Path) -> None:
    from attngrad.distributed import (
        DistributedError,
        init_from_env,
        ring_attention_backward,
        ring_attention_forward,
        shard,
    )
    from attngrad.distributed.launch import shutdown

    rank, world = init_from_env(GLOO_TIMEOUT)
    for i, (layout, causal, kind) in enumerate(CASES):
        arrays, opts = problem(world, layout, causal, kind)
        sh = {n: shard(a, layout, rank, world) for n, a in arrays.items()}
        ring_opts = {n: (shard(a, layout, rank, world, axis=1) if n in SHARDED else a) for n, a in opts.items()}
        out, cache = ring_attention_forward(sh["q"], sh["k"], sh["v"], layout=layout, **ring_opts)
        g = ring_attention_backward(sh["dout"], cache)
        np.savez(outdir / f"case{i}_rank{rank}.npz", out=out, **{f"d{n}": a for n, a in g.items()})
    if world != 2:
        shutdown()
        return
    (outdir / f"errors_rank{rank}.json").write_text(json.dumps(_error_cases(rank, world)))
    # Last: rank 1 dies; rank 0 must get a clear error, not wait.
    if rank == 1:
        os._exit(3)
    x = np.random.default_rng(0).standard_normal((1, 1, 4, 2))
    t0 = time.monotonic()
    try:
        for _ in range(50):
            ring_attention_forward(x, x, x)
        msg = "no error"
    except DistributedError as exc:
        msg = f"DistributedError: {exc}"
    (outdir / "crash.json").write_text(json.dumps({"error": msg, "seconds": time.monotonic() - t0}))
    os._exit(0)


def _error_cases(rank: int, world: int) -> dict:
    """Bad calls: every rank must raise (here, not in a hang), then the group still works."""
    from attngrad.distributed import ring_attention_backward, ring_attention_forward

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 4, 3))
    found = {}

    def attempt(name, fn):
        try:
            fn()
            found[name] = "no error"
        except (ValueError, TypeError) as exc:
            found[name] = f"{type(exc).__name__}: {exc}"

    attempt("window", lambda: ring_attention_forward(q, q, q, window=(2, 0)))
    attempt("alibi", lambda: ring_attention_forward(q, q, q, alibi_slopes=np.ones(2)))
    q_odd = q[:, :, :3] if rank == 1 else q  # rank 1 holds a shard of another length
    attempt("mismatch", lambda: ring_attention_forward(q_odd, q_odd, q_odd))
    q_int = q.astype(np.int64) if rank == 1 else q
    attempt("dtype_one_rank", lambda: ring_attention_forward(q_int, q_int, q_int))
    attempt("causal_cross", lambda: ring_attention_forward(q, q[:, :, :2], q[:, :, :2], causal=True))
    attempt("zigzag_odd", lambda: ring_attention_forward(q[:, :, :3], q[:, :, :3], q[:, :, :3], layout="zigzag"))
    out, cache = ring_attention_forward(q, q, q, causal=True)
    bad = out[:, :, :2] if rank == 0 else out
    attempt("dout_one_rank", lambda: ring_attention_backward(bad, cache))
    g = ring_attention_backward(out, cache)  # the group is still usable
    found["after"] = "ok" if np.isfinite(g["q"]).all() else "not finite"
    return found


# ---------------------------------------------------------------- the tests

if __name__ != "__main__":
    import importlib.util

    import pytest

    if importlib.util.find_spec("torch") is None:  # not imported here: the ranks import it
        pytest.skip("needs PyTorch (torch.distributed)", allow_module_level=True)

    import attngrad
    from attngrad.distributed import unshard
    from attngrad.distributed.launch import launch_local, summarize_failure

    @pytest.fixture(scope="module")
    def groups(tmp_path_factory):
        """group(P) -> (folder, per-rank results): one group of P processes per P, run once.
        In the group of 2, rank 1 finally dies on purpose (exit 3)."""
        done = {}

        def run(world: int):
            if world not in done:
                d = tmp_path_factory.mktemp(f"ring-{world}")
                res = launch_local([__file__, str(d)], world, timeout=180, grace=15, echo_rank0=False, log_dir=d)
                want = [0, 3] if world == 2 else [0] * world
                assert [r.returncode for r in res] == want, summarize_failure(res)
                done[world] = (d, res)
            return done[world]

        return run

    def _ref(arrays, opts):
        out, cache = attngrad.sdpa_forward(arrays["q"], arrays["k"], arrays["v"], impl="dense", **opts)
        g = attngrad.sdpa_backward(arrays["dout"], cache)
        return {"out": out, **{f"d{n}": a for n, a in g.items()}}

    def _rel(a, b) -> float:
        scale = np.max(np.abs(b)) if b.size else 0.0
        diff = np.max(np.abs(a - b)) if b.size else 0.0
        return float(diff / scale) if scale else float(diff)

    @pytest.mark.slow  # real processes
    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    @pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
    def test_ring_equals_one_process(groups, world, case):
        d, _ = groups(world)
        layout, causal, kind = CASES[case]
        arrays, opts = problem(world, layout, causal, kind)
        want = _ref({n: a.astype(np.float64) for n, a in arrays.items()}, opts)
        plain = _ref(arrays, opts) if kind == "f32" else None  # one process, float32
        shards = [np.load(d / f"case{case}_rank{r}.npz") for r in range(world)]
        assert set(shards[0].files) == set(want)
        for name, ref in want.items():
            if name == "dsinks":  # (H,), all-reduced: the same on every rank
                got = shards[0][name]
                for s in shards[1:]:
                    assert np.array_equal(s[name], got)
            else:
                got = unshard([s[name] for s in shards], layout)
            assert got.shape == ref.shape and got.dtype == arrays["q"].dtype
            if plain is None:
                assert _rel(got, ref) <= REL, (name, _rel(got, ref))
            else:  # FlashAttention's rule: at most twice the error of one float32 process
                assert _rel(got, ref) <= max(2 * _rel(plain[name], ref), 1e-6), (name, _rel(got, ref))
            assert np.isfinite(got).all()

    def test_padding_rows_are_exactly_zero(groups):
        """Rows with no key (a batch row fully padded) give output 0 and dQ 0 exactly."""
        d, _ = groups(2)
        i = CASES.index(("zigzag", True, "gqa_pad"))
        shards = [np.load(d / f"case{i}_rank{r}.npz") for r in range(2)]
        for s in shards:
            assert not s["out"][-1].any() and not s["dq"][-1].any()

    def test_bad_calls_raise_on_every_rank(groups):
        d, _ = groups(2)
        e0, e1 = (json.loads((d / f"errors_rank{r}.json").read_text()) for r in range(2))
        for e in (e0, e1):
            assert e["window"].startswith("ValueError") and "window" in e["window"]
            assert e["alibi"].startswith("ValueError") and "alibi_slopes" in e["alibi"]
            assert e["causal_cross"].startswith("ValueError") and "Lq == Lk" in e["causal_cross"]
            assert e["zigzag_odd"].startswith("ValueError") and "multiple of 2" in e["zigzag_odd"]
            assert e["after"] == "ok"
        assert "differ from rank 0" in e1["mismatch"] or "disagree" in e1["mismatch"]
        assert e0["mismatch"].startswith("ValueError")
        assert e1["dtype_one_rank"].startswith("TypeError") and "int64" in e1["dtype_one_rank"]
        assert e0["dtype_one_rank"].startswith("ValueError") and "rank(s) [1]" in e0["dtype_one_rank"]
        assert e0["dout_one_rank"].startswith("ValueError") and "dout" in e0["dout_one_rank"]
        assert "rank(s) [0]" in e1["dout_one_rank"]

    def test_dead_peer_gives_a_clear_error(groups):
        d, res = groups(2)
        assert res[1].returncode == 3 and res[0].returncode == 0  # rank 0 ended on its own
        rec = json.loads((d / "crash.json").read_text())
        assert rec["error"].startswith("DistributedError") and "peer" in rec["error"]
        assert rec["seconds"] < GLOO_TIMEOUT

    def test_no_rank_left_behind(groups):
        folders = [str(groups(w)[0]) for w in (1, 2)]
        alive = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    cmd = (p / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if any(f in cmd for f in folders):
                    alive.append(cmd)
        assert alive == []

    # ------------------------------------------------------------ the command line

    def _cli(*args, env=None, timeout=120):
        e = {**os.environ, **(env or {})}
        return subprocess.run([sys.executable, "-m", "attngrad", *args], capture_output=True, text=True,
                              timeout=timeout, env=e, stdin=subprocess.DEVNULL)

    @pytest.mark.slow  # real processes
    def test_cli_ring_json():
        r = _cli("ring", "--nproc", "2", "--len", "32", "--causal", "--heads", "2", "--kv-heads", "1",
                 "--dim", "4", "--json")
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert [x["rank"] for x in res["ranks"]] == [0, 1]
        assert all(e <= REL for e in res["max_rel_err"].values()), res["max_rel_err"]
        assert all(x["bytes_sent"] > 0 and x["peak_numpy_mb"] > 0 for x in res["ranks"])

    @pytest.mark.parametrize("args,words", [
        (("--nproc", "8", "--len", "4"), "shorter than the 16 chunks"),
        (("--nproc", "3", "--len", "16"), "multiple of 6"),
        (("--nproc", "0", "--len", "16"), "--nproc"),
    ])
    def test_cli_ring_refuses(args, words):
        r = _cli("ring", *args)
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr

    def test_cli_ring_port_in_use():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            r = _cli("ring", "--nproc", "2", "--len", "8", "--port", str(port))
        assert r.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1

    def _unused_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    @pytest.mark.slow  # real processes
    @pytest.mark.parametrize("rank,words", [("0", "not every rank joined"), ("1", "could not join")])
    def test_missing_or_unreachable_peer(rank, words):
        env = {"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_unused_port())}
        # A hang would run into subprocess.run's timeout (TimeoutExpired fails the test); the
        # process itself gives up after --timeout 2 s, plus its start (slow on a busy machine).
        r = _cli("ring", "--distributed", "--nproc", "2", "--len", "8", "--timeout", "2", env=env, timeout=120)
        assert r.returncode == 1 and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
