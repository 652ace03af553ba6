"""What `ragcache bench gpu` counts besides time: the GPU work a call issues (launches) and the
times it made the host wait (syncs)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_syncs(fn: Callable[[], Any]) -> int:
    """How many times `fn` made the host wait for the GPU (CUDA's sync debug mode warns on each)."""
    return len(host_sync_sites(fn))


def host_sync_sites(fn: Callable[[], Any],
                    debug_mode: Callable[[str], None] = torch.cuda.set_sync_debug_mode) -> list[str]:
    """Each time `fn` made its thread wait for the GPU, the Python line that asked (file:line, from
    the warning CUDA's sync debug mode raises there). The mode is process-wide: waits on other
    threads meanwhile (the disk tier's writers waiting for their host copies) are not counted."""
    caller = threading.get_ident()
    sites: list[str] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if threading.get_ident() == caller and "synchroniz" in str(message):
            sites.append(f"{_short_path(filename)}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        debug_mode("warn")
        try:
            fn()
        finally:
            debug_mode("default")
    return sites


def first_sync_stack(fn: Callable[[], Any], frames: int = 14,
                     debug_mode: Callable[[str], None] = torch.cuda.set_sync_debug_mode) -> str | None:
    """Where `fn` first makes the host wait for the GPU, as the Python stack that led there (sync
    debug mode set to raise), or None when it never does. A warning names one line; this names
    the calls above it."""
    import traceback

    debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        stack = traceback.extract_tb(exc.__traceback__)[-frames:]
        return "".join(f"{_short_path(f.filename)}:{f.lineno} {f.name}\n" for f in stack)
    finally:
        debug_mode("default")
    return None


def site_counts(sites: list[str]) -> dict[str, int]:
    """file:line -> how many times, in order of first appearance."""
    return dict(Counter(sites))


def _short_path(filename: str) -> str:
    """A source path from the package's folder on (engine_sidecar/..., kernels/...), else as given."""
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("engine_sidecar", "ragcache_integrations", "kernels", "ragcache_kernels", "torch"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor):])
    return filename


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


def profile_tables(device: torch.device, fn: Callable[[], Any], rows: int = 25, trace: Path | None = None) -> str:
    """Where one call of `fn` spends its time: torch.profiler's operators by total device time
    (on CUDA) and by host self time, as text tables (after one call outside the profiler); on
    CUDA also the call's timeline (when the device starts, its busy time and its idle gaps), and
    the profiler's trace written to `trace` when given."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _stderr_silenced(), profile(activities=activities) as prof:
        fn()
        sync(device)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    parts = []
    if device.type == "cuda":
        try:
            parts.append(timeline(prof.events()))
        except Exception as exc:  # noqa: BLE001 - a profiler without these fields must not lose the tables
            parts.append(f"timeline: not available ({type(exc).__name__}: {exc})")
        parts.append(averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    parts.append(averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    parts.append(python_profile(device, fn, rows))
    return "\n".join(parts)


def timeline(events: Any, gap_us: float = 20.0, shown: int = 8) -> str:
    """One profiled call on a timeline: from the first host op to the device's first kernel, the
    device's busy and idle time up to its last, and its longest idle gaps with the host ops that
    ran meanwhile (what the device waited for)."""
    cuda = torch.autograd.DeviceType.CUDA
    device_spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    host = [e for e in events if e.device_type != cuda and e.cpu_parent is None]
    if not device_spans or not host:
        return "timeline: no device work recorded"
    begin = min(e.time_range.start for e in host)
    busy, gaps, end = 0.0, [], device_spans[0][0]
    for start, stop in device_spans:
        if start - end > gap_us:
            gaps.append((start - end, end, start))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    lines = [f"timeline (µs from the first host op): device starts at {device_spans[0][0] - begin:.0f}, ends at "
             f"{end - begin:.0f}; busy {busy:.0f}, idle {end - device_spans[0][0] - busy:.0f} "
             f"({len(gaps)} gaps over {gap_us:.0f} µs)"]
    for length, start, stop in sorted(gaps, reverse=True)[:shown]:
        meanwhile = [e.name for e in host if e.time_range.start < stop and e.time_range.end > start]
        names = ", ".join(dict.fromkeys(meanwhile)) or "nothing recorded"
        lines.append(f"  gap {length:.0f} µs at {start - begin:.0f}: host ran {names[:300]}")
    return "\n".join(lines) + "\n"


def python_profile(device: torch.device, fn: Callable[[], Any], rows: int = 25, calls: int = 5) -> str:
    """cProfile of `calls` calls of `fn` (the host's Python time, which bounds a request whose
    kernels are small), by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    sync(device)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"cProfile, {calls} calls, by own time:\n")
    stats.sort_stats("tottime").print_stats(rows)
    text.write(f"cProfile, {calls} calls, by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()
