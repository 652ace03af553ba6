"""What `ragcache bench gpu` counts besides time: the GPU work a call issues (launches) and the
times it made the host wait (syncs)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_syncs(fn: Callable[[], Any]) -> int:
    """How many times `fn` made the host wait for the GPU (CUDA's sync debug mode warns on each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach a backend kernel on this thread (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """The profiler's C++ side prints a line on every start and stop: kept out of the report."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def launches(device: torch.device, fn: Callable[[], Any]) -> int:
    """The work `fn` issues: on CUDA the kernels and copies the GPU ran (Triton's included, from
    any thread), else the aten ops that reach a kernel on this thread, views excluded (on a GPU
    each would be a launch). The host's cost per launch is what bounds a request whose kernels
    are small."""
    if device.type != "cuda":
        with _OpCounter() as counter:
            fn()
        return counter.count
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
