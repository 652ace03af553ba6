"""The Engine's read API (what the server, CLI and replicas ask instead of its attributes):
plain values that agree with what the engine holds."""

from __future__ import annotations

import time

from ragcache_integrations.types import ChunkedPrompt, SamplingParams

PASSAGES = ["The Nile flows north through Egypt into the Mediterranean Sea.",
            "Mount Fuji is the highest mountain in Japan, near Tokyo."]


def test_health_names_the_model_device_and_tiers(tiny_engine, tiny_llama_dir, tmp_path):
    health = tiny_engine.health()
    assert health.failure is None
    assert (health.model, health.model_path) == (tiny_llama_dir.name, str(tiny_llama_dir))
    assert (health.device, health.dtype) == ("cpu", "float32")
    assert health.max_context == tiny_engine.max_context > 0
    assert health.disk_dir == tmp_path / "kv" and health.redis_url is None


def test_stats_count_what_a_request_stored(tiny_engine):
    before = tiny_engine.stats()
    assert before.store.ram_entries == 0 and before.waiting == before.running == 0
    tiny_engine.generate(ChunkedPrompt(chunks=PASSAGES, question="Which river flows north?",
                                       conversation_id="talk"), SamplingParams(max_tokens=2))
    after = tiny_engine.stats()
    assert after.store.ram_entries >= len(PASSAGES)
    assert after.conversations == 1
    ram, lower = tiny_engine.held_chunk_ids()
    assert len(ram) == len(PASSAGES) and not lower


def test_kv_rows_peak_at_the_prompt_and_answer_a_request_held(tiny_engine):
    """A request of n prompt tokens and m answer tokens reserves n + m + 1 rows and writes n + m - 1
    (its last token is never fed back); once it ends nothing is held, and a reset starts the
    peaks from there."""
    assert tiny_engine.stats().kv_rows.peak_reserved == 0
    result = tiny_engine.generate(ChunkedPrompt(chunks=PASSAGES, question="Which river flows north?"),
                                  SamplingParams(max_tokens=5, ignore_eos=True))
    n, m = result.stats.prefill_tokens_total, len(result.token_ids)
    assert m == 5
    # the result is posted inside the scheduler's last step; the count is taken at the step's end
    waited = time.monotonic()
    while tiny_engine.stats().kv_rows.reserved and time.monotonic() - waited < 60:
        time.sleep(0.01)
    rows = tiny_engine.stats().kv_rows
    assert (rows.peak_reserved, rows.peak_used) == (n + m + 1, n + m - 1)
    assert (rows.reserved, rows.used) == (0, 0)
    tiny_engine.reset_kv_peaks()
    assert tiny_engine.stats().kv_rows.peak_used == 0


def test_tokens_round_trip_and_the_prompt_holds_the_passages(tiny_engine):
    ids = tiny_engine.encode(PASSAGES[0])
    assert tiny_engine.decode(list(ids)) == PASSAGES[0]
    prompt_ids = tiny_engine.prompt_token_ids(ChunkedPrompt(chunks=PASSAGES[:1], question="Where?"))
    assert len(prompt_ids) > len(ids)


def test_prefill_graphs_swap_back(tiny_engine):
    own = tiny_engine.use_prefill_graphs(None)  # on a CPU there are none
    assert own is None and tiny_engine.use_prefill_graphs(own) is None
    assert tiny_engine.decode_graphs() is None
    assert tiny_engine.load_cost_ratio("redis") is None
