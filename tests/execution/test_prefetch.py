"""Layer-wise prefetch: the preload-depth formula, per-layer reads that verify each layer, and
the engine reading disk-tier KV layer by layer with the same result as a synchronous load."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine_sidecar import Engine
from engine_sidecar.execution.prefetch import preload_depth
from engine_sidecar.store.disk import DamagedCacheFile, DiskTier
from engine_sidecar.store.entry import ChunkKV

PASSAGES = ["The Amazon river flows through Brazil into the Atlantic Ocean. " * 4,
            "The Danube flows through ten countries into the Black Sea. " * 4,
            "The Mekong rises in Tibet and reaches the sea in Vietnam. " * 4]
PROMPT = {"chunks": PASSAGES[::-1], "question": "Which river reaches the Black Sea?"}


@pytest.mark.parametrize("layers, compute, load, depth", [(30, 1.0, 0.5, 1), (30, 1.0, 1.0, 1), (30, 1.0, 2.0, 15),
                                                          (30, 1.0, 4.0, 23), (30, None, 4.0, 1), (4, 1.0, 1e9, 4)])
def test_preload_depth_by_hand(layers, compute, load, depth):
    assert preload_depth(layers, compute, load) == depth


def stored_chunk(directory, digest: str, layers: int, tokens: int):
    """A random chunk written to a disk tier and opened lazily: (tier, keys, values, lazy entry)."""
    tier = DiskTier(directory)
    keys, values = torch.randn(layers, tokens, 2, 4), torch.randn(layers, tokens, 2, 4)
    tier.put(digest, ChunkKV(keys, values, torch.arange(tokens)))
    tier.flush()
    return tier, keys, values, tier.lazy(digest)


def test_layer_reader_reads_each_layer_and_catches_a_damaged_one(tmp_path):
    tier, keys, values, lazy = stored_chunk(tmp_path, "ab" * 20, layers=3, tokens=5)
    assert lazy is not None and lazy.reader is not None and lazy.keys.shape == keys.shape
    assert torch.equal(lazy.token_ids, torch.arange(5))
    for layer in range(3):
        k, v = lazy.reader.layer(layer)
        assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])
    path = tier.path_for("ab" * 20)
    data = bytearray(path.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])  # the tail: values of the last layer
    path.write_bytes(bytes(data))
    damaged = tier.lazy("ab" * 20)
    assert damaged is not None
    damaged.reader.layer(0)
    with pytest.raises(DamagedCacheFile):
        damaged.reader.layer(2)
    assert not path.exists() and tier.corrupt_files_seen == 1


def cold_engine(model_dir, cache, prefetch: bool) -> Engine:
    return Engine.from_pretrained(model_dir, device="cpu", dtype="float32", cache_dir=cache, prefix_tree=False,
                                  prefetch=prefetch)


def test_prefetched_prefill_equals_synchronous_load_and_lands_in_ram(tiny_llama_dir, tmp_path):
    cache = tmp_path / "kv"
    with cold_engine(tiny_llama_dir, cache, True) as warm:
        warm.warm(PASSAGES)
        warm.cache.store.flush()
    with cold_engine(tiny_llama_dir, cache, False) as sync:
        expected, sync_stats = sync.prefill_logits(PROMPT, policy="cacheblend")
    with cold_engine(tiny_llama_dir, cache, True) as engine:
        result = engine.generate(PROMPT, {"max_tokens": 1}, policy="cacheblend")
        times = result.stats.stage_times
        assert times["prefetch_read_s"] > 0 and times["prefetch_depth"] >= 1 and "prefetch_wait_s" in times
        assert engine.cache.store.hits_disk == 4 and len(engine.cache.store.ram) == 4  # 3 chunks + the template prefix
        assert engine.cache.costs.load["disk"] > 0
    with cold_engine(tiny_llama_dir, cache, True) as engine:
        logits, stats = engine.prefill_logits(PROMPT, policy="cacheblend")
        assert stats.chunk_hits == sync_stats.chunk_hits == 3
        assert torch.allclose(logits, expected, atol=1e-5)


def test_a_file_damaged_mid_read_becomes_a_miss_not_an_error(tiny_llama_dir, tmp_path):
    cache = tmp_path / "kv"
    with cold_engine(tiny_llama_dir, cache, True) as warm:
        warm.warm(PASSAGES)
        warm.cache.store.flush()
        expected = warm.generate(PROMPT, {"max_tokens": 4}, policy="full").token_ids
    for path in sorted(cache.glob("*/*.kv.safetensors")):
        data = bytearray(path.read_bytes())
        data[-32:] = bytes(b ^ 0xFF for b in data[-32:])
        path.write_bytes(bytes(data))
    with cold_engine(tiny_llama_dir, cache, True) as engine:
        result = engine.generate(PROMPT, {"max_tokens": 4}, policy="cacheblend:1.0")
        assert result.stats.chunk_misses == 3
        assert result.token_ids == expected  # ratio 1.0 recomputes everything: full prefill's answer


def test_probes_and_the_shared_prefill_meet_a_damaged_file_as_requests_do(tiny_llama_dir, tmp_path):
    """The fidelity probes and the prefill shared with vLLM take the engine's one prefill path: a
    file found damaged while it is read layer by layer is planned again as a miss, not an error."""
    cache = tmp_path / "kv"
    with cold_engine(tiny_llama_dir, cache, True) as warm:
        warm.warm(PASSAGES)
        warm.cache.store.flush()
        expected, _ = warm.prefill_logits(PROMPT, policy="full")
    for path in sorted(cache.glob("*/*.kv.safetensors")):
        data = bytearray(path.read_bytes())
        data[-32:] = bytes(b ^ 0xFF for b in data[-32:])
        path.write_bytes(bytes(data))
    damaged_copy = tmp_path / "kv-copy"
    shutil.copytree(cache, damaged_copy)
    with cold_engine(tiny_llama_dir, cache, True) as engine:
        logits, stats = engine.prefill_logits(PROMPT, policy="cacheblend:1.0")
        assert stats.chunk_misses == 3 and engine.cache.store.disk.corrupt_files_seen > 0
        assert torch.allclose(logits, expected, atol=1e-4)  # everything recomputed: full prefill's logits
    with cold_engine(tiny_llama_dir, damaged_copy, True) as engine:
        run = engine.split.prefix(PROMPT, "cacheblend", "", upto=10_000)
        assert run.chunk_hits == 0 and run.result is not None and engine.cache.store.disk.corrupt_files_seen > 0


def test_bench_prefetch_measures_both_modes_cold(tiny_llama_dir, tmp_path):
    import json

    from engine_sidecar.cli.main import main

    out = tmp_path / "prefetch.json"
    assert main(["bench", "prefetch", "--data", "fanoutqa", "--n", "2", "--k", "3", "--repeats", "1",
                 "--model", str(tiny_llama_dir), "--cache-dir", str(tmp_path / "kv"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["mode"] for r in rows].count("sync") == [r["mode"] for r in rows].count("prefetch") == 2
    assert all(r["chunk_hits"] == 3 for r in rows)  # cold RAM, warm disk: every chunk comes from disk
    assert all("prefetch_read_s" in r["stage_times"] for r in rows if r["mode"] == "prefetch")
    assert not any("prefetch_read_s" in r["stage_times"] for r in rows if r["mode"] == "sync")
    assert result["summary"]["ttft_ratio_prefetch_vs_sync_median"] > 0
    assert "TTFT prefetch / sync" in out.with_suffix(".md").read_text()


def test_runs_merge_small_gaps():
    from engine_sidecar.store.disk import row_runs

    assert row_runs(torch.tensor([0, 1, 2, 5, 6, 20]), max_gap=1) == [(0, 3), (5, 7), (20, 21)]
    assert row_runs(torch.tensor([0, 1, 2, 5, 6, 20]), max_gap=2) == [(0, 7), (20, 21)]
    assert row_runs(torch.tensor([], dtype=torch.long), max_gap=3) == []


def test_sparse_rows_are_verified_and_scores_are_stored(tmp_path):
    from engine_sidecar.store.frequency import frequency_scores

    tier, keys, values, lazy = stored_chunk(tmp_path, "cd" * 20, layers=2, tokens=40)
    assert torch.allclose(lazy.scores, frequency_scores(keys, values))
    got = lazy.reader.rows(1, torch.tensor([3, 4, 30]), max_gap=0)
    assert [(a, b) for a, b, _, _ in got] == [(3, 5), (30, 31)]
    assert torch.equal(got[0][2], keys[1, 3:5]) and torch.equal(got[1][3], values[1, 30:31])
    assert lazy.reader.rows_read == 3
    path = tier.path_for("cd" * 20)
    header = int.from_bytes(path.read_bytes()[:8], "little")
    data = bytearray(path.read_bytes())
    # damage one value row of layer 1 (values come after keys in the file, stored alphabetically)
    import json

    info = json.loads(data[8 : 8 + header])["values"]["data_offsets"]
    row_bytes = 2 * 4 * 4
    at = 8 + header + info[0] + (40 + 30) * row_bytes  # layer 1, token 30
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = tier.lazy("cd" * 20)
    damaged.reader.rows(1, torch.tensor([3, 4]), max_gap=0)  # untouched rows still read
    with pytest.raises(DamagedCacheFile):
        damaged.reader.rows(1, torch.tensor([30]), max_gap=0)


def test_cachetune_sparse_load_equals_full_load_and_is_not_promoted(tiny_llama_dir, tmp_path):
    cache = tmp_path / "kv"
    with cold_engine(tiny_llama_dir, cache, True) as warm:
        warm.warm(PASSAGES)
        warm.generate(PROMPT, {"max_tokens": 1}, policy="cachetune:0.3")  # stores the template prefix
        warm.cache.store.flush()
    with cold_engine(tiny_llama_dir, cache, False) as sync:
        expected, _ = sync.prefill_logits(PROMPT, policy="cachetune:0.3")
    with cold_engine(tiny_llama_dir, cache, True) as engine:
        result = engine.generate(PROMPT, {"max_tokens": 1}, policy="cachetune:0.3")
        assert result.stats.stage_times["prefetch_rows_skipped"] == result.stats.tokens_recomputed > 0
        assert len(engine.cache.store.ram) == 1  # only the fully read template prefix; sparse chunks are not kept
    with cold_engine(tiny_llama_dir, cache, True) as engine:
        logits, stats = engine.prefill_logits(PROMPT, policy="cachetune:0.3")
        assert stats.chunk_hits == 3
        assert torch.allclose(logits, expected, atol=1e-5)
