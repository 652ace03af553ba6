"""What the decode and prefill graphs share: whether a runner can replay CUDA graphs at all, and
capturing one step.

A step is captured once its Triton kernels have compiled and the allocator has settled: two
runs on a side stream first, then the capture. Graphs of one owner share a memory pool, which is
safe because the owner never replays two at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from engine_sidecar.model.runner import ModelRunner
from ragcache_kernels import dispatch

Output = TypeVar("Output")


def graphs_unavailable(runner: ModelRunner, what: str) -> str | None:
    """Why this runner cannot replay `what` ("decode graphs", "prefill graphs") from CUDA graphs,
    or None."""
    if runner.device.type != "cuda":
        return "CUDA graphs need a GPU"
    if dispatch.resolve_backend(runner.device) != "triton":
        return f"{what} need the Triton kernels (RAGCACHE_KERNELS is not torch, and triton imports)"
    if runner.config.moe is not None:
        return f"{what} cannot capture routed experts (which experts run is read back every layer)"
    if len(set(runner.layer_windows)) > 1:
        return f"{what} hold one attention window, and this model's layers differ in theirs"
    return None


def capture_step(device: torch.device, pool: object, step: Callable[[], Output]) -> tuple[torch.cuda.CUDAGraph,
                                                                                          Output]:
    """`step` run twice on a side stream (compiling the Triton kernels and settling the
    allocator), then captured into a graph on `pool`; the graph and the captured run's output,
    which every replay overwrites."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    # thread_local: the store's copy stream may be busy on another thread meanwhile
    with torch.cuda.graph(captured, pool=pool, capture_error_mode="thread_local"):
        output = step()
    return captured, output
