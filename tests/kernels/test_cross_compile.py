"""Every Triton kernel compiles for an H100 (sm_90a) at the engine's shapes, within its limits,
on this machine without a GPU (`python -m ragcache_kernels.cross_compile`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = {"selective_attention_kernel", "merge_splits_kernel", "deviation_kernel", "scatter_rows_kernel",
           "rope_kernel", "rope_store_kernel", "silu_mul_kernel", "append_rows_kernel", "decode_attention_kernel",
           "store_from_table_kernel", "attend_from_table_kernel"}


def _cross_compile(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # a process of its own: under TRITON_INTERPRET=1 (as other kernel tests run) `triton.jit`
    # makes interpreted functions, which do not compile
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    return subprocess.run([sys.executable, "-m", "ragcache_kernels.cross_compile", *flags], env=env,
                          capture_output=True, text=True, timeout=900, check=False)


def test_every_kernel_compiles_for_sm90_without_spilling_at_the_engines_shapes(tmp_path: Path) -> None:
    out = tmp_path / "cross.json"
    done = _cross_compile(tmp_path, "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["target"]["capability"] == 90
    assert report["failures"] == []
    variants = report["variants"]
    assert {v["kernel"] for v in variants} == KERNELS
    # ptxas read every variant, and every one fits the card
    assert all(v["registers"] is not None and v["spill_bytes"] is not None for v in variants)
    assert [v for v in variants if v["problems"]] == []
    # fp32 attention tiles were once 64 x 64, which ptxas compiled to 32 registers and ~40 KB of
    # spills per thread on sm_90: the fp32 variants now keep their operands in registers
    fp32_attention = [v for v in variants if v["kernel"] in {"selective_attention_kernel", "decode_attention_kernel"}
                      and any("float32" in launch for launch in v["launches"])]
    assert fp32_attention and all(v["spill_bytes"] == 0 for v in fp32_attention)
    assert "Triton kernels compiled for NVIDIA H100 (sm_90a)" in done.stdout
    # prompts of varying lengths, recompute counts and decode batches compile a bounded set:
    # with or without split keys, and nothing per size or split count (sizes specialised, the same
    # stream once compiled 13 variants of selective attention, 7 of decode attention, 3 merges)
    stream = report["stream_variants"]
    assert set(stream) == KERNELS
    assert stream["selective_attention_kernel"] <= 2 and stream["decode_attention_kernel"] <= 2
    assert stream["attend_from_table_kernel"] <= 2  # every prefill graph bucket, split or not
    assert all(stream[name] == 1 for name in ("merge_splits_kernel", "deviation_kernel", "scatter_rows_kernel",
                                              "rope_kernel", "rope_store_kernel", "silu_mul_kernel",
                                              "append_rows_kernel", "store_from_table_kernel"))


def test_the_command_refuses_the_interpreter_and_unknown_shapes(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "ragcache_kernels.cross_compile", "--shapes", "8b"], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "unset it" in done.stderr and "Traceback" not in done.stderr
    done = _cross_compile(tmp_path, "--shapes", "70b")
    assert done.returncode == 2 and "unknown shape or dtype: 70b" in done.stderr
