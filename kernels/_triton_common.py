"""Helpers shared by the Triton launchers and dispatch; deliberately free of any triton import."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (CPU tests), not compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands must be upcast to fp32 for this input dtype.

    The interpreter computes tl.dot on bf16 operands wrongly (values off by orders of magnitude,
    measured with triton 3.9), so under the interpreter bf16 tiles are cast to fp32 first. On a
    GPU, bf16 dots are native and keep their tensor-core speed.
    """
    return dtype == torch.bfloat16 and interpreting()


def check_device(*tensors: torch.Tensor) -> None:
    if any(t.device.type == "cpu" for t in tensors) and not interpreting():
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 to run on CPU")


# Segment one-hot tiles of the attention-mass kernel live in registers next to the output tile;
# past this many segments the kernel refuses and dispatch uses the torch reference.
MAX_MASS_SEGMENTS = 256


def rows_are_dense(t: torch.Tensor) -> bool:
    """Whether everything after dim 0 is one dense run, so each row is a flat span of memory."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
