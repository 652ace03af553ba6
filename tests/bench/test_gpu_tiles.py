"""`bench gpu`'s tile sweep: every candidate tile computes the same attention, and the sweep reports
each launch's default against its best (run here through Triton's CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ragcache_kernels import attention as reference  # noqa: E402
from ragcache_kernels import triton_attention  # noqa: E402
from ragcache_lab.gpu import timed  # noqa: E402
from ragcache_lab.gpu_tiles import LAUNCHES, default_tile, tile_lines, tile_name, tile_sweep  # noqa: E402


@pytest.mark.parametrize("tile", triton_attention.TILE_CANDIDATES, ids=tile_name)
def test_every_candidate_tile_computes_the_reference_attention(tile):
    m, n, warps, stages = tile
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(rows, heads, 64, generator=gen) for rows, heads in ((37, 4), (300, 2), (300, 2)))
    query_pos = torch.randperm(300, generator=gen)[:37].sort().values
    key_pos = torch.arange(300)
    for splits in (1, None):  # one program per query block and head, and the keys split when few
        got, _ = triton_attention.selective_attention(q, k, v, query_pos, key_pos, block_m=m, block_n=n,
                                                      splits=splits, num_warps=warps, num_stages=stages)
        expected = reference.selective_attention(q, k, v, query_pos, key_pos)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_sweep_times_every_candidate_against_the_default():
    rows = tile_sweep(torch.device("cpu"), True, timed, heads=(("tiny heads", 2, 1, 64),), keys=200)
    assert [r["launch"] for r in rows] == [name for name, _ in LAUNCHES]
    names = {tile_name(t) for t in triton_attention.TILE_CANDIDATES}
    for row in rows:
        assert set(row["ms"]) == names and all(ms > 0 for ms in row["ms"].values())
        # the launch as the engine makes it (the interpreter's own small tiles here; on a GPU one of
        # the candidates), against the fastest candidate
        assert row["default"] == tile_name(default_tile(64, torch.bfloat16)) and row["default_ms"] > 0
        assert row["best_ms"] == min(row["ms"].values())
        assert row["default_over_best"] == round(row["default_ms"] / row["best_ms"], 2)
    assert rows[-1]["queries"] < rows[0]["queries"] < rows[1]["queries"]  # question < fused < every row
    table = tile_lines(rows)
    assert table[2].startswith("| heads | launch |") and len(table) == 4 + len(rows) + 1
