"""``attngrad train --nproc P``: the command-line side of data-parallel training.

``--nproc P`` starts P local ranks, each running this same command with ``--distributed``
(torchrun's conventions: RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT); under
torchrun, ``attngrad train --distributed ...`` is one rank of a group across machines.
"""

from __future__ import annotations

import argparse
import math

from ..distributed.launch import DEFAULT_TIMEOUT, DistributedError, launch_local, summarize_failure
from .args import int_at_least, seconds

_OURS = ("nproc", "distributed", "port", "dist_timeout")
# the defaults of the options above that are None until --config / --preset are read
DEFAULTS = {"nproc": 1, "dist_timeout": DEFAULT_TIMEOUT}


def add_options(p: argparse.ArgumentParser) -> None:
    """The data-parallel options of ``attngrad train``."""
    g = p.add_argument_group("data parallel (torch.distributed, gloo)")
    g.add_argument("--nproc", type=int_at_least(1), default=None,
                   help="train on P local processes, gradients all-reduced (default 1)")
    g.add_argument("--distributed", action="store_true",
                   help="run as one rank of a group started by torchrun (RANK, WORLD_SIZE, "
                        "MASTER_ADDR, MASTER_PORT)")
    g.add_argument("--port", type=int_at_least(1), default=None, help="with --nproc: MASTER_PORT (default: a free one)")
    g.add_argument("--dist-timeout", type=seconds, default=None,
                   help=f"seconds to wait for a peer in any step (default {DEFAULT_TIMEOUT:g})")
    p.set_defaults(_parser=p)


def rank_argv(args) -> list[str]:
    """The command line each rank runs: the options given here, plus --distributed (and
    --threads, where not given: :func:`attngrad.get_num_threads` shared out among the ranks)."""
    argv = ["-m", "attngrad", "train", "--distributed", "--dist-timeout", repr(args.dist_timeout)]
    for a in args._parser._actions:
        if a.dest in (*_OURS, "help", "_parser") or not a.option_strings:
            continue  # --config, --preset pass on too: they hold options without a flag (beta2)
        value = getattr(args, a.dest, a.default)
        if value is None or value == a.default:
            continue
        flag = a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
            if value == a.const:  # given (or read from --config): the flag; else the default
                argv.append(flag)
        elif a.nargs == "?" and value == a.const:
            argv.append(flag)
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    if getattr(args, "threads", None) is None:  # the ranks share the cores: each its share
        from ..runtime.threads import get_num_threads

        argv += ["--threads", str(max(1, get_num_threads() // args.nproc))]
    return argv


def launch_train(args) -> int:
    """Run the P ranks here; rank 0's output is this command's.  Returns the exit status."""
    results = launch_local(rank_argv(args), args.nproc, port=args.port, timeout=math.inf, echo_rank0=True)
    first = results[0].returncode
    if first == 2:  # bad input: rank 0 has printed the one line
        return 2
    failure = summarize_failure(results)
    if failure:
        raise DistributedError(failure)
    return 0


def check_config(cfg, nproc: int) -> None:
    """Refuse up front what data parallelism cannot do (see :func:`attngrad.train.dp.check_config`)."""
    from ..train.dp import check_config as check

    check(cfg, nproc)


def train_data_parallel(*args, **kwargs):
    """:func:`attngrad.train.dp.train_data_parallel` (imported on use)."""
    from ..train.dp import train_data_parallel as run

    return run(*args, **kwargs)


def rank_train(args):
    """``attngrad.train.train`` as one rank of the group (``--distributed``)."""
    import functools
    import os

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # no C++ log lines: our errors say it
    return functools.partial(train_data_parallel, timeout=args.dist_timeout)
