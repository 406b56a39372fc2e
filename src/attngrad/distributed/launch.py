"""Starting ranks: joining a process group from torchrun's environment, and launching P
local processes with the same conventions (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), watched so that a failed rank ends the run with its error, never a hang.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

DEFAULT_TIMEOUT = 60.0  # seconds: joining the group, and any one message or collective


class DistributedError(RuntimeError):
    """A distributed run failed: a peer died, never joined, or could not be reached."""


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``addr`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_port(port, addr: str = "127.0.0.1") -> int:
    """``port`` as an int if it is valid and free on ``addr``, else a ValueError saying so."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer in [1, 65535]; got {port!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError:
            raise ValueError(f"port {port} on {addr} is in use; pick another (or leave it out for a free one)") from None
    return port


def _env_int(name: str, lo: int) -> int:
    text = os.environ.get(name)
    if text is None:
        raise ValueError(f"environment variable {name} is not set (start ranks with torchrun or attngrad --nproc)")
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {text!r}") from None
    if v < lo:
        raise ValueError(f"environment variable {name} must be >= {lo}; got {v}")
    return v


def init_from_env(timeout: float = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """Join the gloo process group described by torchrun's environment variables.

    ``timeout`` (seconds) bounds the wait for every rank to join and every later collective
    or message, so that a dead or unreachable peer gives a :class:`DistributedError`
    instead of a hang.  Returns (rank, world size)."""
    import torch.distributed as dist

    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if rank >= world:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world}")
    addr = os.environ.get("MASTER_ADDR")
    port = _env_int("MASTER_PORT", 1)
    if not addr:
        raise ValueError("environment variable MASTER_ADDR is not set (the address of rank 0)")
    if addr in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a loopback run uses the loopback only
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # torch's DistError family: translate into one clear line
        raise DistributedError(_join_error(exc, rank, world, addr, port, timeout)) from None
    return rank, world


def _join_error(exc, rank, world, addr, port, timeout) -> str:
    text = str(exc)
    if "EADDRINUSE" in text or "address already in use" in text:
        return f"rank {rank}: MASTER_PORT {port} on {addr} is in use; pick another port"
    if "waiting for clients" in text:
        return (f"rank {rank}: not every rank joined within {timeout:g} s ({text.split('.')[1].strip()}); "
                f"is every rank started, with WORLD_SIZE={world}?")
    return (f"rank {rank}: could not join the group at {addr}:{port} within {timeout:g} s "
            f"({type(exc).__name__}: {text.splitlines()[0][:200] if text else ''})")


def peer_error(exc: BaseException, rank: int) -> DistributedError:
    """A clear error for a collective or message that failed because a peer went away."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "Connection closed" in text or "reset by peer" in text or "Broken pipe" in text:
        why = "a peer process exited (connection lost)"
    elif "imed out" in text:
        why = "a peer stopped answering (timed out)"
    else:
        why = text[:200]
    return DistributedError(f"rank {rank}: {why}; stopping")


def shutdown() -> None:
    """Leave the process group (if joined)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if dist.is_initialized():
        dist.destroy_process_group()


class RankResult(NamedTuple):
    rank: int
    returncode: int
    tail: str  # last line of the rank's error output ("" when it went to the terminal)
    ended: float = 0.0  # seconds after the start at which the launcher saw it end
    stopped: bool = False  # ended by the launcher (after a peer failed, or at the timeout)


def launch_local(argv: list[str], nproc: int, *, port: int | None = None, timeout: float = 600.0,
                 grace: float = 15.0, env: dict | None = None, echo_rank0: bool = True,
                 log_dir=None) -> list[RankResult]:
    """Run ``python <argv>`` as ``nproc`` ranks on this machine (MASTER_ADDR=127.0.0.1).

    Rank 0's output goes to this process's stdout/stderr when ``echo_rank0``; every other
    rank's to a log file.  When a rank fails the others get ``grace`` seconds to notice
    (they stop with their own error) and are then killed; after ``timeout`` seconds all are
    killed.  No process is left behind.  Returns each rank's exit status and last error line."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer; got {nproc!r}")
    port = free_port() if port is None else check_port(port)
    base = {**os.environ, **(env or {})}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    base.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # no C++ log lines: the ranks' errors say it
    tmp = tempfile.TemporaryDirectory(prefix="attngrad-ranks-") if log_dir is None else None
    logs = Path(tmp.name if tmp else log_dir)
    procs, files = [], []
    try:
        for r in range(nproc):
            e = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
            if r == 0 and echo_rank0:
                out = err = None
            else:
                out = open(logs / f"rank{r}.out", "w")  # closed below
                err = open(logs / f"rank{r}.err", "w")
                files += [out, err]
            procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        ended, stopped = _watch(procs, timeout, grace)
        return [RankResult(r, p.returncode, _tail(logs / f"rank{r}.err"), ended[r], r in stopped)
                for r, p in enumerate(procs)]
    finally:
        for p in procs:
            _kill(p)
        for f in files:
            f.close()
        if tmp:
            tmp.cleanup()


def _watch(procs, timeout: float, grace: float) -> tuple[dict, set]:
    """Wait for the ranks; returns when each was seen to end, and which ones we stopped."""
    t0 = time.monotonic()
    failed_at = None
    ended = {}
    while True:
        now = time.monotonic()
        codes = [p.poll() for p in procs]
        for r, c in enumerate(codes):
            if c is not None and r not in ended:
                ended[r] = now - t0
        if all(c is not None for c in codes):
            return ended, set()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if (failed_at is not None and now - failed_at > grace) or now - t0 > timeout:
            stopped = {r for r, c in enumerate(codes) if c is None}
            for p in procs:
                _kill(p)
            return {**{r: now - t0 for r in stopped}, **ended}, stopped
        time.sleep(0.05)


def _kill(p: subprocess.Popen) -> None:
    """End a rank we started (its own session) and reap it."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=5)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _tail(path: Path) -> str:
    try:
        lines = [s for s in path.read_text(errors="replace").splitlines() if s.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def summarize_failure(results: list[RankResult]) -> str | None:
    """One line naming the first rank that failed and why (None when all succeeded)."""
    bad = [r for r in results if r.returncode != 0]
    if not bad:
        return None
    # The first to end, not stopped by the launcher; at a tie, one that did not merely see
    # its peer vanish.
    own = [r for r in bad if not r.stopped] or bad
    first = min(own, key=lambda r: (r.ended, "peer" in r.tail, r.rank))
    why = first.tail or _signal_text(first.returncode)
    return f"rank {first.rank} of {len(results)} failed (exit {first.returncode}): {why}"


def _signal_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "no error output"
