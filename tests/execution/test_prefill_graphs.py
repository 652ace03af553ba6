"""The prefill graphs' fixed-address sparse layers, run op by op by Triton's CPU interpreter.

On a GPU each (row bucket, first layer) is captured once and replayed; what a replay computes is
exactly what these layers compute when run op by op from the same fixed inputs. So here: the
table kernels equal the executor's own launches (padded rows storing nothing, split keys, a
sliding window); a fused prefill through the graphs gives the op-by-op prefill's logits and KV
for `reuse`, CacheBlend (graphs from the layer after its check) and a graph reused by a later,
shorter prompt; what no graph serves runs op by op; and each policy says where its rows stop
changing. The capture itself needs a GPU: `ragcache bench gpu` guards it there.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny64(smol_dir, tmp_path_factory):
    """A tiny Llama with head_dim 64 (a size the kernels are built for), GQA ratio 3, 3 layers."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny64-prefill-graphs"), "llama", tokenizer_from=smol_dir,
                           hidden_size=192, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=3)


@pytest.fixture
def triton_kernels(monkeypatch):
    monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _buffers(layers, capacity, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(layers, capacity, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("splits", "window"), [(1, None), (3, None), (2, 24)])
def test_table_kernels_equal_the_executors_launches(triton_kernels, dtype, splits, window):
    """Layer 1 of a 3-layer buffer, 70 keys, 5 rows padded to a bucket of 8: the table kernels
    store the same rows and attend the same way as rope_and_store and selective_attention on
    that layer's views; the padded rows store nothing, and no other layer is touched."""
    from ragcache_kernels import triton_attention, triton_rope
    from ragcache_kernels import triton_prefill_table as table

    heads, kv_heads, d, n, layer = 3, 1, 64, 70, 1
    rows = torch.tensor([3, 17, 40, 41, 69])
    bucket = 8
    gen = torch.Generator().manual_seed(1)
    joint = torch.randn(bucket, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    expected = _buffers(3, 80, kv_heads, d, dtype)
    got = [t.clone() for t in expected]

    q_ref = triton_rope.rope_and_store(joint[: len(rows)], heads, kv_heads, rows, inv_freq,
                                       *(t[layer] for t in expected))
    out_ref, _ = triton_attention.selective_attention(q_ref, expected[1][layer, :n], expected[2][layer, :n], rows,
                                                      None, window)

    inputs = torch.zeros(table.TABLE_SIZE + bucket, dtype=torch.int64)
    inputs[: table.TABLE_SIZE] = torch.tensor(table.table_values(*got, n, len(rows)))
    inputs[table.TABLE_SIZE :] = torch.cat([rows, torch.full((bucket - len(rows),), n - 1)])
    view = table.PrefillTable(inputs[: table.TABLE_SIZE], inputs[table.TABLE_SIZE :], heads, kv_heads, d, splits,
                              window)
    q = view.store(layer, joint, inv_freq)
    out = view.attend(layer, q)

    assert torch.equal(q[: len(rows)], q_ref)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)  # the same five rows written, padded rows and other layers untouched
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out[: len(rows)].float(), out_ref.float(), atol=tol, rtol=tol)
    assert torch.isfinite(out).all()  # padded rows too


def test_table_values_refuse_what_does_not_fit():
    from ragcache_kernels import triton_prefill_table as table

    buffers = _buffers(2, 10, 1, 64, torch.float32)
    assert table.table_values(*buffers, 10, 3)[table.NUM_KEYS :] == [10, 3, 2]
    with pytest.raises(ValueError, match="do not fit"):
        table.table_values(*buffers, 11, 3)
    with pytest.raises(ValueError, match="do not fit"):
        table.table_values(*buffers, 4, 5)
    with pytest.raises(ValueError, match="contiguous"):
        table.table_values(buffers[0][:, ::2], buffers[1][:, ::2], buffers[2][:, ::2], 4, 2)
    odd = [torch.empty(2 * 10 * 64 + 1)[1:].view(2, 10, 1, 64) for _ in range(3)]  # 4-byte aligned only
    assert not table.addressable(*odd) and table.addressable(*buffers)
    with pytest.raises(ValueError, match="aligned"):
        table.table_values(*odd, 4, 2)


def _runner(model_dir, dtype="float32"):
    from engine_sidecar.model.runner import ModelRunner

    return ModelRunner.load(model_dir, device="cpu", dtype=dtype)


def _fused_plan(runner, tokens, seed=0):
    """The kernel warm-up's made-up prompt: chunks stored from a full prefill, placed in reverse
    order at new positions, and a fresh question."""
    from engine_sidecar.execution import kernel_warmup

    ids = kernel_warmup.made_up_ids(tokens, runner.config.vocab_size, seed)
    return kernel_warmup.fused_plan(ids, kernel_warmup.full_kv(runner, ids))


def _sentinel_buffers(runner):
    """`allocate` for fused_prefill: buffers whose every row starts as 7, so a test sees which
    rows a prefill wrote."""
    from engine_sidecar.execution.kv_buffer import KVBuffer

    def allocate(rows):
        kv = KVBuffer.allocate(runner, rows)
        for t in (kv.keys_pre, kv.keys, kv.values):
            t.fill_(7.0)
        return kv

    return allocate


def _prefill(runner, plan, policy, graphs=None):
    from engine_sidecar.execution.fused_prefill import fused_prefill

    return fused_prefill(runner, plan, policy, capacity=plan.num_tokens + 6, allocate=_sentinel_buffers(runner),
                         graphs=graphs)


def _same_result(eager, graphed, atol):
    assert graphed.token_layers_computed == eager.token_layers_computed
    assert graphed.fused_tokens_recomputed == eager.fused_tokens_recomputed
    assert torch.allclose(graphed.logits, eager.logits, atol=atol, rtol=atol), \
        (graphed.logits - eager.logits).abs().max()
    assert graphed.logits.argmax() == eager.logits.argmax()
    for a, b in ((eager.kv.keys_pre, graphed.kv.keys_pre), (eager.kv.keys, graphed.kv.keys),
                 (eager.kv.values, graphed.kv.values)):
        assert torch.allclose(a.float(), b.float(), atol=atol, rtol=atol)
        assert torch.equal(b[:, eager.kv.length :], torch.full_like(b[:, eager.kv.length :], 7.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reuse_through_the_graphs_equals_op_by_op(tiny64, triton_kernels, dtype):
    """`reuse` chooses its rows before layer 0, so a graph runs every layer: the question's rows
    (16 here, padded to a bucket of 20) over 160 keys, keys split three ways."""
    from engine_sidecar.execution.policies.plain import ReusePolicy
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs

    runner = _runner(tiny64, dtype)
    plan = _fused_plan(runner, 160)
    graphs = PrefillGraphs(runner, max_context=512, capture=False, splits=3, buckets=(8, 20, 64))
    eager = _prefill(runner, plan, ReusePolicy())
    graphed = _prefill(runner, plan, ReusePolicy(), graphs)
    _same_result(eager, graphed, 2e-3 if dtype == "float32" else 5e-2)
    assert set(graphs.graphs) == {(20, 0)} and graphs.replays == 1


def test_a_graph_slower_than_its_launches_runs_op_by_op(tiny64, triton_kernels):
    """A graph timed at capture as slower to replay than its layers are to launch (a large model's
    many padded rows) serves its prefills op by op, with the op-by-op result; one timed faster
    replays."""
    from engine_sidecar.execution.policies.plain import ReusePolicy
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs

    runner = _runner(tiny64, "float32")
    plan = _fused_plan(runner, 160)
    graphs = PrefillGraphs(runner, max_context=512, capture=False, splits=2, buckets=(20, 64))
    graphs.capture_all((0,))
    graph = graphs.graphs[(20, 0)]
    assert graph.replays_faster(160, runner.num_layers)  # untimed (no device to time it on): replays
    eager = _prefill(runner, plan, ReusePolicy())
    graph.launch_s, graph.replay_s = 1e-3, 2e-3
    _same_result(eager, _prefill(runner, plan, ReusePolicy(), graphs), 2e-3)
    assert (graphs.replays, graphs.launched) == (0, 1)
    assert graphs.summary(160)[0] == {"rows": 20, "first_layer": 0, "launch_ms": 1.0, "replay_ms": 2.0,
                                   "replays": False}
    graph.replay_s = 0.5e-3
    _same_result(eager, _prefill(runner, plan, ReusePolicy(), graphs), 2e-3)
    assert (graphs.replays, graphs.launched) == (1, 1)


def test_launches_hidden_behind_the_dense_layers_count_against_a_replay():
    """CacheBlend's graph on the 8B shape as timed on an H200: 1,024 rows from layer 2 of 32,
    launched op by op in 24.8 ms, replayed in 18.3 ms. Op by op, the launches overlap the two dense
    layers over every prompt row (2 x 6,091 rows x 18.3 ms / (1,024 x 30) = 7.26 ms), which leaves
    17.5 ms of launches: shorter than the replay, so a 6,091-row prompt runs op by op; a 1,000-row
    one (1.19 ms hidden) replays."""
    from engine_sidecar.execution.prefill_graphs import SparseGraph

    empty = torch.zeros(0)
    graph = SparseGraph(1024, 2, empty, empty, empty, None, launch_s=24.8e-3, replay_s=18.3e-3)
    assert not graph.replays_faster(6091, 32)
    assert graph.replays_faster(1000, 32)
    reuse = SparseGraph(64, 0, empty, empty, empty, None, launch_s=13.8e-3, replay_s=7.0e-3)
    assert reuse.replays_faster(6091, 32)  # from layer 0 nothing hides the launches
    # a small bucket's replay is mostly the weights' read: the dense layers' time per row comes from
    # the largest bucket (16 rows in 1.65 ms would make two dense layers over 6,091 rows 90 ms)
    few = SparseGraph(16, 2, empty, empty, empty, None, launch_s=8.45e-3, replay_s=1.65e-3)
    assert not few.replays_faster(6091, 16)
    assert few.replays_faster(6091, 16, row_layer_s=3.18e-3 / (1024 * 14))  # 2.7 ms hidden: 5.75 ms left


def test_cacheblend_replays_the_layers_after_its_check(tiny64, triton_kernels):
    """CacheBlend chooses at layer 1: layers 0 and 1 run op by op, layer 2 from the graph; a second,
    shorter prompt whose kept rows (44, then 37) fall in the same bucket replays the same graph."""
    from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs

    runner = _runner(tiny64)
    graphs = PrefillGraphs(runner, max_context=512, capture=False, splits=2)
    for tokens, seed in ((200, 0), (150, 3)):
        plan = _fused_plan(runner, tokens, seed)
        eager = _prefill(runner, plan, CacheBlendPolicy(0.15))
        graphed = _prefill(runner, plan, CacheBlendPolicy(0.15), graphs)
        _same_result(eager, graphed, 2e-3)
        assert 0 < eager.fused_tokens_recomputed < eager.fused_tokens
    assert set(graphs.graphs) == {(64, 2)} and graphs.replays == 2


def test_what_no_graph_serves_runs_op_by_op(tiny64, triton_kernels, monkeypatch):
    """More rows than the largest bucket, a prompt past the context the keys were split for, every
    row active (full prefill) and the torch kernels: no replay, the op-by-op result."""
    from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy
    from engine_sidecar.execution.policies.plain import FullPolicy, ReusePolicy
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs

    runner = _runner(tiny64)
    plan = _fused_plan(runner, 120)
    small = PrefillGraphs(runner, max_context=512, capture=False, splits=1, buckets=(16,))
    short = PrefillGraphs(runner, max_context=100, capture=False, splits=1)
    for policy in (CacheBlendPolicy(0.5), FullPolicy()):
        eager = _prefill(runner, plan, policy)
        for graphs in (small, short):
            _same_result(eager, _prefill(runner, plan, policy, graphs), 2e-3)
    monkeypatch.setenv("RAGCACHE_KERNELS", "torch")
    assert _prefill(runner, plan, ReusePolicy(), short).logits is not None
    assert small.replays == short.replays == 0 and not small.graphs and not short.graphs


def test_the_engine_prefills_through_the_graphs(tiny64, triton_kernels, tmp_path):
    """Stored passages asked in a new order: greedy answers under `reuse` and CacheBlend are the
    same with the engine's prefill stage replaying graphs as without, and its prefills replayed."""
    from engine_sidecar import Engine
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs
    from ragcache_integrations import ChunkedPrompt

    passages = ["The Nile flows north through Egypt into the Mediterranean Sea, past Cairo and its delta.",
                "Kilimanjaro, the highest mountain in Africa, stands in Tanzania near the Kenyan border.",
                "Lake Victoria is shared by Uganda, Kenya and Tanzania and feeds the White Nile."]
    sampling = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False, cache_dir=tmp_path) as engine:
        engine.warm(passages)
        prompts = [ChunkedPrompt(chunks=passages[::-1], question=f"Which river, {i}?") for i in range(2)]
        plain = [engine.generate(p, sampling, policy=policy).token_ids
                 for p, policy in zip(prompts, ("reuse", "cacheblend:0.3"), strict=True)]
        graphs = PrefillGraphs(engine.runner, engine.max_context, capture=False, splits=2)
        engine.prefill_stage.graphs = graphs
        replayed = [engine.generate(p, sampling, policy=policy).token_ids
                    for p, policy in zip(prompts, ("reuse", "cacheblend:0.3"), strict=True)]
    assert replayed == plain and all(len(t) == 5 for t in plain)
    assert graphs.replays == 2 and {first for _, first in graphs.graphs} == {0, 2}


def test_capture_all_builds_every_bucket_that_requests_then_replay(tiny64, triton_kernels):
    """What the engine captures at load on a GPU: every bucket from layer 0 and from the layer
    after CacheBlend's check. Requests of both kinds then replay those graphs and build none."""
    from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy
    from engine_sidecar.execution.policies.plain import ReusePolicy
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs

    runner = _runner(tiny64)
    graphs = PrefillGraphs(runner, max_context=512, capture=False, splits=2, buckets=(16, 32, 64))
    count, seconds = graphs.capture_all((0, 2))
    assert count == 6 and seconds >= 0 and set(graphs.graphs) == {(b, f) for b in (16, 32, 64) for f in (0, 2)}
    built = dict(graphs.graphs)
    plan = _fused_plan(runner, 200)
    for policy in (ReusePolicy(), CacheBlendPolicy(0.15)):
        _same_result(_prefill(runner, plan, policy), _prefill(runner, plan, policy, graphs), 2e-3)
    assert graphs.graphs == built and graphs.replays == 2


def test_each_policy_says_where_its_rows_stop_changing():
    from engine_sidecar.execution.policies.cachecraft import CacheCraftPolicy
    from engine_sidecar.execution.policies.registry import parse_policy

    assert parse_policy("reuse").final_refine_layer(30) == -1
    assert parse_policy("epic:16").final_refine_layer(30) == -1
    assert parse_policy("prophet:0.15:nowindow").final_refine_layer(30) == -1
    assert parse_policy("cacheblend:0.15").final_refine_layer(30) == 1
    assert parse_policy("cacheblend:1.0").final_refine_layer(30) == -1
    assert parse_policy("cacheblend:0.136:gradual").final_refine_layer(30) == 3
    assert parse_policy("mix:0.15:split").final_refine_layer(30) == 1
    assert CacheCraftPolicy().final_refine_layer(30) == 29  # may stop early on any layer


def test_a_cpu_engine_ignores_the_setting_and_says_so(tiny64, tmp_path, caplog):
    from engine_sidecar import Engine
    from engine_sidecar.engine_config import EngineConfig

    assert EngineConfig().batching.prefill_graphs == "auto"
    with caplog.at_level(logging.WARNING, logger="ragcache.prefill_graphs"):
        with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False, cache_dir=tmp_path) as engine:
            assert engine.prefill_stage.graphs is None
        assert "no effect" not in caplog.text  # the default runs op by op where graphs cannot, silently
        with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False, cache_dir=tmp_path,
                                    prefill_graphs="on") as engine:
            assert engine.prefill_stage.graphs is None
    assert "--prefill-graphs on has no effect here: CUDA graphs need a GPU" in caplog.text
