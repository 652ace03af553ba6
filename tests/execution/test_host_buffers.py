"""Large host tensors on transparent huge pages: ordinary tensors to every caller."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_sidecar.execution import host_buffers


def test_a_large_buffer_is_an_ordinary_writable_tensor() -> None:
    t = host_buffers.empty((4, 1024, 3, 64), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (4, 1024, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.fill_(2.5)
    view = t[1:3, 10:20]
    assert float(view.float().sum()) == 2.5 * view.numel()
    del t
    assert float(view.float().mean()) == 2.5  # a view keeps the mapping alive


def test_a_small_buffer_is_torch_empty() -> None:
    t = host_buffers.empty((3, 5), torch.float32, torch.device("cpu"))
    assert t.shape == (3, 5) and t.untyped_storage().nbytes() == 60


def _huge_pages_allowed() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


@pytest.mark.skipif(not _huge_pages_allowed(), reason="transparent huge pages are off on this machine")
def test_a_large_buffer_is_backed_by_huge_pages() -> None:
    t = host_buffers.empty((64 << 20,), torch.uint8, torch.device("cpu"))
    t.fill_(1)
    start = t.data_ptr()
    huge_kb = 0
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if "-" in line.split(" ")[0] and not line.startswith(("AnonHuge", "Size")):
            low, high = (int(part, 16) for part in line.split(" ")[0].split("-"))
            if low <= start < high:
                huge_kb = next(int(entry.split()[1]) for entry in lines[i + 1 :] if entry.startswith("AnonHugePages:"))
                break
    assert huge_kb > 0
