"""Decode over the block pool: sequences whose KV moved into blocks decode what a full forward of
each extended sequence gives, alone or in a batch beside sequences with buffers of their own, in
every family's attention layout; and the pre-RoPE keys rotated back from the pool are the ones the
prefill computed."""

from __future__ import annotations

import pytest
import torch

from engine_sidecar.execution.batched_decode import decode_batch
from engine_sidecar.execution.block_pool import BlockPool
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.paged_kv import PagedKV
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import FullPolicy
from engine_sidecar.model.runner import ModelRunner
from tests.conftest import make_family_model


def _prefill(runner: ModelRunner, ids: list[int], capacity: int):
    plan = FusionPlan([PlanSpan("question", 0, tuple(ids), "fresh")], "full")
    return fused_prefill(runner, plan, FullPolicy(), capacity=capacity).kv


@pytest.mark.parametrize("model_type,dtype,tol,paged_mask", [
    ("llama", "float32", 1e-4, (True, True, True)),
    ("llama", "float32", 1e-4, (True, False, True)),  # a batch of both kinds
    ("mistral", "float32", 1e-4, (True, True, False)),  # a sliding window exceeded, per sequence
    ("gemma3_text", "float32", 1e-4, (True, False, True)),  # two RoPE tables, window and global layers
    ("qwen3", "float32", 1e-4, (True, True, True)),
    # bf16: logits here reach ~1.5, where a bf16 step is 0.008; the bound holds for the buffers'
    # own decode too (last row), which is the reference the paged path must match
    ("llama", "bfloat16", 4e-2, (True, False, True)),
    ("llama", "bfloat16", 4e-2, (False, False, False)),
])
def test_paged_decode_equals_full_forward(tmp_path, model_type, dtype, tol, paged_mask):
    runner = ModelRunner.load(make_family_model(tmp_path / model_type, model_type), device="cpu", dtype=dtype)
    # blocks of 4 rows: every sequence spans several, and the steps below cross block edges
    pool = BlockPool(runner.config, runner.dtype, "cpu", block_size=4, num_blocks=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    kvs = []
    for ids, paged in zip(prompts, paged_mask, strict=True):
        kv = _prefill(runner, ids, len(ids) + 1)
        kvs.append(PagedKV.from_buffer(pool, kv, len(ids) + 8) if paged else kv)
    seqs = [list(ids) for ids in prompts]
    for step in range(6):
        tokens = [int(t) for t in torch.randint(3, 256, (3,), generator=gen)]
        logits = decode_batch(runner, kvs, tokens)
        for i, token in enumerate(tokens):
            seqs[i].append(token)
            expected = runner.forward(torch.tensor(seqs[i]))[-1]
            assert (logits[i].float() - expected.float()).abs().max().item() < tol, (step, i)
            assert kvs[i].length == len(seqs[i])
    held = sum(len(kv.table.blocks) for kv in kvs if isinstance(kv, PagedKV))
    assert held == sum(pool.blocks_for(len(s)) for s, p in zip(seqs, paged_mask, strict=True) if p)
    for kv in kvs:
        if isinstance(kv, PagedKV):
            kv.release()
    assert pool.free_blocks == pool.num_blocks


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3"])
def test_keys_rotated_back_from_the_pool_are_the_prefills_pre_rope_keys(tmp_path, model_type):
    """A conversation's history needs pre-RoPE keys: rotating the pool's keys back by each layer's
    own table gives what the prefill computed (phi3: partial rotary; gemma3: two tables)."""
    runner = ModelRunner.load(make_family_model(tmp_path / model_type, model_type), device="cpu", dtype="float32")
    pool = BlockPool(runner.config, runner.dtype, "cpu", block_size=8, num_blocks=16)
    ids = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = _prefill(runner, ids, len(ids))
    paged = PagedKV.from_buffer(pool, kv, len(ids))
    rebuilt = paged.to_buffer(runner)
    assert rebuilt.length == kv.length == len(ids)
    torch.testing.assert_close(rebuilt.keys, kv.keys[:, : len(ids)], rtol=0, atol=0)
    torch.testing.assert_close(rebuilt.values, kv.values[:, : len(ids)], rtol=0, atol=0)
    torch.testing.assert_close(rebuilt.keys_pre, kv.keys_pre[:, : len(ids)], rtol=1e-5, atol=1e-5)
    # and it is not the rotated keys themselves (which would pass where positions are all 0)
    assert (kv.keys[:, 1:len(ids)] - kv.keys_pre[:, 1:len(ids)]).abs().max() > 1e-2


def test_a_batch_that_would_run_out_of_blocks_fails_before_touching_any_table(tmp_path):
    runner = ModelRunner.load(make_family_model(tmp_path / "m", "llama"), device="cpu", dtype="float32")
    pool = BlockPool(runner.config, runner.dtype, "cpu", block_size=4, num_blocks=2)
    kv = PagedKV.from_buffer(pool, _prefill(runner, list(range(3, 11)), 8), 8)  # both blocks full
    with pytest.raises(RuntimeError, match="blocks needed"):
        decode_batch(runner, [kv], [5])
    assert kv.length == 8 and len(kv.table.blocks) == 2
