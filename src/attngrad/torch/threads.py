"""PyTorch's thread count as attngrad's default inside the drop-ins.

A PyTorch program says how many threads it may use with ``torch.set_num_threads`` (or
``OMP_NUM_THREADS``); attngrad's work inside its operators takes the same count, unless
attngrad was told otherwise (:func:`attngrad.set_num_threads`, ``ATTNGRAD_NUM_THREADS``):
:func:`attngrad.runtime.threads.framework_threads`.
"""

from __future__ import annotations

import functools

import torch

from attngrad.runtime.threads import framework_threads


def torch_threads(fn):
    """``fn`` run with attngrad's default thread count set to ``torch.get_num_threads()``
    at the call (its signature kept, for :func:`torch.library.custom_op`)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with framework_threads(torch.get_num_threads()):
            return fn(*args, **kwargs)

    return call
