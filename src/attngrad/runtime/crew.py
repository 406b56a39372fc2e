"""The crew: workers that take the blocks of :func:`.products.matmuls` (the layers' large
products) without a system call to wake them.

Handed to the unit pool's sleeping threads (:func:`.parallel.run_units`), each product
paid a system call to wake a worker and the worker started its first block 0.1-0.3 ms
after the caller, so that a hand-out of two 0.28 ms halves took 0.53 ms instead of 0.28
on this project's 2-vCPU VM (docs/benchmarks.md, the language-model step; a language-model
step makes ~50 hand-outs).  A crew member is a task of that same pool whose thread runs a
compiled loop (:func:`._block_kernels.member_loop`): between jobs it polls a mailbox every
POLL_US microseconds (sleeping in ``usleep`` meanwhile, so that its core is free: a member
spinning there instead slowed the caller's memory-bound work by a third), and takes blocks
from the job's counter as soon as one is published; the same hand-out took 0.32 ms.  A
member stops polling after IDLE_SECONDS without a job, and at once when the pool is given
other work (:func:`stand_down`, called by :func:`.parallel.run_units`).

Memory: a member reads a job's record and tables only after it is published, and a job is
kept here until no member that may still read it is left (each member records the last
job it finished); the operands themselves are read only while the job has blocks left,
and :func:`run` returns when every block is written.  Linux only (``usleep``, and
``prctl`` for a 1 µs timer slack); elsewhere :func:`run` declines and the caller uses
:func:`.parallel.run_units`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from concurrent.futures import Future

import numpy as np

POLL_US = 20  # a member's sleep between two looks at the mailbox
IDLE_SECONDS = 0.005  # polling without a job for this long, a member's thread goes back to sleep
_PR_SET_TIMERSLACK = 29  # prctl: how late the kernel may wake a sleeping thread (default 50 µs)

_LOCK = threading.Lock()
_CREW = None  # the process's crew, False where there is none
_SLACKED: set = set()  # threads whose timer slack is set


class _Task:
    """A unit-pool task handed to a member: run once unless its future was cancelled."""

    def __init__(self, fn):
        self.fn = fn
        self.future = Future()

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.fn()
        except BaseException as exc:  # the caller re-raises it through the future
            self.future.set_exception(exc)
        else:
            self.future.set_result(None)


class _Crew:
    """The mailbox, the members' state and the jobs they may still read."""

    def __init__(self, kernels, members: int, libc):
        self.k = kernels
        self.members = members
        self.box = np.zeros(kernels.BOX_FIELDS + kernels.MEMBER_FIELDS * members, dtype=np.int64)
        self.queued = [False] * members  # a member's pool task submitted and not yet returned
        self.tasks: list = [None] * members  # a _Task waiting for each member
        self.busy = [False] * members  # a member running a task (a nested hand-out must not wait for it)
        self.pending: list = []  # (job number, arrays) a member may still read
        self.usleep = ctypes.cast(libc.usleep, ctypes.c_void_p).value
        self.prctl = libc.prctl
        self.max_polls = max(1, int(IDLE_SECONDS * 1e6 / POLL_US))

    def field(self, w: int, name: str) -> int:
        return self.k.BOX_FIELDS + self.k.MEMBER_FIELDS * w + getattr(self.k, name)

    def serve(self, w: int, blas) -> None:
        """The pool task of member ``w``: polls for jobs (compiled), runs the tasks posted
        to it in between, and returns once idle or told to stop with no task waiting."""
        me = threading.get_ident()
        if me not in _SLACKED:
            self.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # woken within ~1 µs of each poll
            _SLACKED.add(me)
        leave = self.field(w, "LEAVE")
        while True:
            try:
                self.k.member_loop(blas, self.box, w, self.usleep, POLL_US, self.max_polls)
            finally:
                with _LOCK:
                    task, self.tasks[w] = self.tasks[w], None
                    self.box[leave] = 0
                    self.busy[w] = task is not None
                    if task is None:
                        self.queued[w] = False
            if task is None:
                return
            try:
                task()
            finally:
                self.busy[w] = False

    def release(self, newest: int) -> None:
        """Forget the jobs older than ``newest`` that no member can still be reading: a
        member in its loop (or about to enter it) may read a job no older than the one
        after the last it finished."""
        floor = newest
        for w in range(self.members):
            if self.box[self.field(w, "LIVE")] or self.queued[w]:
                floor = min(floor, int(self.box[self.field(w, "DONE")]) + 1)
        self.pending = [(e, refs) for e, refs in self.pending if e >= floor]


def _forget() -> None:
    """In a forked child: the parent's members are not there."""
    global _CREW, _LOCK
    _CREW, _LOCK = None, threading.Lock()
    _SLACKED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _make(members: int):
    """A crew of ``members`` members, or False where the platform has none."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.usleep, libc.prctl  # noqa: B018 - both must exist
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    from . import _block_kernels

    return _Crew(_block_kernels, members, libc)


def _crew():
    """The process's crew, one member per thread besides the caller's
    (:func:`attngrad.get_num_threads`); None where there is none.  Made anew for another
    count once no member of the old one is left."""
    global _CREW
    from .threads import get_num_threads

    members = get_num_threads() - 1
    if members < 1:
        return None
    if _CREW is None or (_CREW and _CREW.members != members and not any(_CREW.queued)):
        _CREW = _make(members)
    return _CREW or None


def post(fns: list) -> list | None:
    """Hand each callable of ``fns`` to a member that is polling and free, and return
    their futures; None (nothing handed out) where fewer members are free: then the
    caller submits them to the unit pool after :func:`stand_down`."""
    crew = _CREW
    if not crew or not fns:
        return None
    with _LOCK:
        free = [w for w in range(crew.members)
                if crew.queued[w] and not crew.busy[w] and crew.tasks[w] is None]
        if len(free) < len(fns):
            return None
        tasks = [_Task(fn) for fn in fns]
        for w, task in zip(free, tasks, strict=False):  # the first len(fns) free members
            crew.tasks[w] = task
            crew.box[crew.field(w, "LEAVE")] = 1
    return [t.future for t in tasks]


def stand_down() -> None:
    """Tell the members with no task waiting to leave their loop now, so that their
    threads return to the unit pool: before that pool is given other work."""
    crew = _CREW
    if not crew:
        return
    with _LOCK:
        for w in range(crew.members):
            if crew.queued[w] and crew.tasks[w] is None:
                crew.box[crew.field(w, "LEAVE")] = 2


def job(prods: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The record :func:`._block_kernels.run_job` takes: where the tables lie, their
    lengths, and the counters of blocks taken and finished (the caller keeps the tables
    alive while it runs)."""
    from . import _block_kernels as k

    rec = np.zeros(k.JOB_FIELDS, dtype=np.int64)
    rec[k.PRODS], rec[k.N_PRODS] = prods.ctypes.data, prods.shape[0]
    rec[k.TABLE], rec[k.N_BLOCKS] = table.ctypes.data, table.shape[0]
    return rec


def run(prods: np.ndarray, table: np.ndarray, workers: int) -> bool:
    """The blocks of ``table`` (int64 (nb, 6)) over the products ``prods`` (int64 (np,
    N_FIELDS)) on the calling thread and the crew's members (``workers`` > 1: at least two
    blocks and cores); returns when every block is written (True), or at once with False
    where there is no crew (the caller then runs them)."""
    from . import fused
    from .parallel import _placement, _unit_pool

    crew = _crew() if workers > 1 else None
    if crew is None:
        return False
    k = crew.k
    blas = fused.products()[1]
    rec = job(prods, table)
    with _LOCK:
        epoch = k.publish(crew.box, rec.ctypes.data)
        crew.pending.append((epoch, (rec, prods, table)))  # until no member may read it
        crew.release(epoch)
        idle = [w for w in range(crew.members) if not crew.queued[w]]
        for w in idle:
            crew.queued[w] = True
    if idle:
        pool = _unit_pool(crew.members)
        _placement(crew.members + 1, pool)  # the members' threads off the caller's CPU
        for w in idle:
            pool.submit(crew.serve, w, blas)
    k.run_and_wait(blas, rec)
    return True
