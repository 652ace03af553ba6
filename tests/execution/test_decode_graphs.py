"""The graph decoder's fixed-address step, run op by op by Triton's CPU interpreter.

On a GPU each bucket's step is captured once and replayed; what a replay computes is exactly what
this step computes when run op by op from the same fixed inputs. So here: the step (a padded
bucket, a fixed key split, sequences that grow and sequences of one row) gives the eager batched
step's logits and writes the same KV rows; padded rows touch no sequence; what no bucket serves
falls back; the scheduler decodes through it; and a CPU engine asked for graphs says it ignores
the setting. The capture itself needs a GPU: `ragcache bench gpu` guards it there.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("triton")

from ragcache_integrations import ChunkedPrompt  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny64(smol_dir, tmp_path_factory):
    """A tiny Llama with head_dim 64 (a size the kernels are built for) and GQA ratio 3."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny64-graphs"), "llama", tokenizer_from=smol_dir,
                           hidden_size=192, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=2)


def _sequences(runner, shapes, seed=0):
    from engine_sidecar.execution.kv_buffer import KVBuffer

    gen = torch.Generator().manual_seed(seed)
    kvs = []
    for length, capacity in shapes:
        kv = KVBuffer.allocate(runner, capacity)
        for t in (kv.keys_pre, kv.keys, kv.values):
            t.copy_(torch.randn(t.shape, generator=gen))
        kv.length = length
        kvs.append(kv)
    return kvs


def _copies(kvs):
    from engine_sidecar.execution.kv_buffer import KVBuffer

    return [KVBuffer(kv.keys_pre.clone(), kv.keys.clone(), kv.values.clone(), kv.length) for kv in kvs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("splits", [1, 4])
def test_fixed_step_equals_the_eager_step(tiny64, dtype, splits, monkeypatch):
    """Three sequences (bucket 4: one padded row) decode four steps; the middle one grows on the
    first step, the last starts at one row. Four key slices leave most slices of these short
    sequences empty."""
    from engine_sidecar.execution.batched_decode import decode_batch
    from engine_sidecar.execution.decode_graphs import DecodeGraphs
    from engine_sidecar.model.runner import ModelRunner

    monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
    runner = ModelRunner.load(tiny64, device="cpu", dtype=dtype)
    eager = _sequences(runner, ((5, 9), (17, 17), (1, 4)))
    fixed = _copies(eager)
    graphs = DecodeGraphs(runner, max_batch=8, max_context=64, capture=False, splits=splits)
    atol = 2e-3 if dtype == "float32" else 6e-2
    for step in ([11, 12, 13], [40, 41, 42], [7, 8, 9], [100, 200, 300]):
        reference = decode_batch(runner, eager, step).float()
        got = graphs.decode(fixed, step)
        assert got is not None and got.shape == reference.shape
        assert torch.allclose(got.float(), reference, atol=atol, rtol=1e-2), (got.float() - reference).abs().max()
    assert set(graphs.graphs) == {4} and graphs.replays == 4
    for a, b, start in zip(eager, fixed, (5, 17, 1), strict=True):
        assert a.length == b.length == start + 4 and a.capacity == b.capacity
        for x, y in ((a.keys_pre, b.keys_pre), (a.keys, b.keys), (a.values, b.values)):
            assert torch.equal(x[:, :start], y[:, :start])  # the rows before the steps, untouched
            assert torch.allclose(x[:, : a.length].float(), y[:, : b.length].float(), atol=atol, rtol=1e-2)


def test_padded_rows_touch_no_sequence(tiny64, monkeypatch):
    """One sequence in a bucket of 2: the padded row writes the scratch buffer only, so every row
    of the sequence past its new one keeps what it held."""
    from engine_sidecar.execution.decode_graphs import DecodeGraphs
    from engine_sidecar.model.runner import ModelRunner

    monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
    runner = ModelRunner.load(tiny64, device="cpu", dtype="float32")
    (kv,) = _sequences(runner, ((6, 12),))
    before = [t.clone() for t in (kv.keys_pre, kv.keys, kv.values)]
    graphs = DecodeGraphs(runner, max_batch=2, max_context=64, capture=False, splits=2)
    graphs.graphs[2] = graphs._build(2)  # the padded bucket, used for a single sequence
    graphs.buckets = (2,)
    assert graphs.decode([kv], [5]) is not None
    assert kv.length == 7
    for old, new in zip(before, (kv.keys_pre, kv.keys, kv.values), strict=True):
        assert torch.equal(old[:, :6], new[:, :6]) and torch.equal(old[:, 7:], new[:, 7:])
        assert not torch.equal(old[:, 6], new[:, 6])  # the new row was written


def test_what_no_graph_serves_falls_back(tiny64, monkeypatch):
    from engine_sidecar.execution.decode_graphs import DecodeGraphs
    from engine_sidecar.model.runner import ModelRunner

    monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
    runner = ModelRunner.load(tiny64, device="cpu", dtype="float32")
    graphs = DecodeGraphs(runner, max_batch=2, max_context=16, capture=False, splits=1)
    assert graphs.buckets == (1, 2)
    three = _sequences(runner, ((3, 8), (3, 8), (3, 8)))
    assert graphs.decode(three, [1, 2, 3]) is None  # more sequences than the largest bucket
    (long,) = _sequences(runner, ((16, 20),))
    assert graphs.decode([long], [1]) is None  # past the context the key split was sized for
    monkeypatch.setenv("RAGCACHE_KERNELS", "torch")
    (short,) = _sequences(runner, ((3, 8),))
    assert graphs.decode([short], [1]) is None  # the torch kernels asked for
    assert short.length == 3 and long.length == 16 and all(kv.length == 3 for kv in three)
    assert graphs.replays == 0


def test_the_scheduler_decodes_through_the_graphs(tiny64, tmp_path, monkeypatch):
    """Greedy generation of two concurrent requests gives the same tokens with the graph decoder
    in the scheduler as without, and its steps really ran."""
    from engine_sidecar import Engine
    from engine_sidecar.execution.decode_graphs import DecodeGraphs

    monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
    sampling = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    prompts = [ChunkedPrompt(chunks=["The Nile flows north into the Mediterranean Sea."], question="Where?"),
               ChunkedPrompt(chunks=["Kilimanjaro is in Tanzania."], question="Which country?")]
    with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False, cache_dir=tmp_path) as engine:
        plain = [engine.generate(p, sampling, policy="full").token_ids for p in prompts]
        graphs = DecodeGraphs(engine.runner, max_batch=4, max_context=engine.max_context, capture=False, splits=2)
        engine.scheduler.graphs = graphs
        with ThreadPoolExecutor(len(prompts)) as clients:  # concurrent: decoded in one batch
            replayed = list(clients.map(lambda p: engine.generate(p, sampling, policy="full").token_ids, prompts))
    assert replayed == plain and all(len(t) == 6 for t in plain)
    assert graphs.replays >= 5


def test_a_cpu_engine_ignores_the_setting_and_says_so(tiny64, tmp_path, caplog):
    from engine_sidecar import Engine
    from engine_sidecar.execution.decode_graphs import DecodeGraphs

    with caplog.at_level(logging.WARNING, logger="ragcache.decode_graphs"):
        with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False, cache_dir=tmp_path,
                                    decode_graphs="on") as engine:
            assert engine.scheduler.graphs is None
            assert DecodeGraphs.unavailable(engine.runner) == "CUDA graphs need a GPU"
    assert "--decode-graphs on has no effect here: CUDA graphs need a GPU" in caplog.text


def test_by_default_a_cpu_engine_decodes_op_by_op_without_a_warning(tiny64, tmp_path, caplog):
    from engine_sidecar import Engine
    from engine_sidecar.engine_config import EngineConfig

    assert EngineConfig().batching.decode_graphs == "auto"
    with caplog.at_level(logging.WARNING, logger="ragcache.decode_graphs"):
        with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False, cache_dir=tmp_path) as engine:
            assert engine.scheduler.graphs is None
    assert "decode-graphs" not in caplog.text
