"""One request must never break the engine, the store or another tenant: extreme sampling and
policy values, non-finite numbers, a failing sequence, a dead scheduler, a request without the
API key. Each reproducer gets a clear 4xx (or a documented greedy answer) and the server answers
the next request as before."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from engine_sidecar import Engine
from engine_sidecar.engine.sampling import GREEDY_BELOW, choose_token
from engine_sidecar.errors import NonFiniteKVError, NonFiniteLogitsError
from engine_sidecar.server import ServerSettings, create_app
from engine_sidecar.store.entry import ChunkKV
from ragcache_integrations.policy_registry import PolicySpecError, parse_policy_spec
from ragcache_integrations.types import SamplingParams
from tests.conftest import make_tiny_model

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PASSAGE = "Mount Fuji is 3,776 m high. The Nile flows north."
GENERATE = {"prompt": {"chunks": [PASSAGE], "question": "Tell me about Mount Fuji and the Nile."},
            "sampling": {"max_tokens": 6}}
TINY_TEMPERATURES = [1.058e-37, 1e-300, 5e-324, GREEDY_BELOW / 2]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                    cache_dir=tmp_path_factory.mktemp("faults") / "kv")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    # a short deadline: a wedged scheduler fails the test in two minutes rather than hanging it
    with TestClient(create_app(engine, ServerSettings(api_key=KEY, max_tokens=16, request_timeout_s=120)),
                    raise_server_exceptions=False) as c:
        yield c


def _generate(client, body, headers=None, **extra):
    return client.post("/v1/generate", json={**body, **extra}, headers={**AUTH, **(headers or {})})


def _with_sampling(**sampling):
    return {**GENERATE, "sampling": {**GENERATE["sampling"], **sampling}}


def _stream_events(response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


# --- sampling -----------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_temperature_below_the_floor_is_greedy(temperature):
    logits = torch.randn(300, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=temperature)
    assert choose_token(logits, params, torch.Generator().manual_seed(1)) == int(logits.argmax())


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_raise_a_clear_error(temperature, bad):
    logits = torch.zeros(50)
    logits[7] = bad
    with pytest.raises(NonFiniteLogitsError, match="non-finite"):
        choose_token(logits, SamplingParams(temperature=temperature), None)


def test_minus_infinity_is_a_masked_token_not_an_error():
    logits = torch.full((10,), float("-inf"))
    logits[4] = 1.0
    assert choose_token(logits, SamplingParams(temperature=0.5), torch.Generator().manual_seed(0)) == 4


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperatures_answer_greedily_on_both_routes(client, temperature, stream):
    greedy = _generate(client, _with_sampling(temperature=0.0)).json()["text"]
    response = _generate(client, _with_sampling(temperature=temperature, seed=1), stream=stream)
    assert response.status_code == 200, response.text
    if stream:
        events = _stream_events(response)
        assert events[-1]["type"] == "done", events[-1]
        assert events[-1]["text"] == greedy
    else:
        assert response.json()["text"] == greedy
    chat = {"messages": [{"role": "user", "content": "Tell me about Mount Fuji."}], "max_tokens": 4}
    plain = client.post("/v1/chat/completions", json=chat, headers=AUTH).json()["choices"][0]["message"]["content"]
    tiny = client.post("/v1/chat/completions", json={**chat, "temperature": temperature, "stream": stream},
                       headers=AUTH)
    assert tiny.status_code == 200, tiny.text
    if not stream:
        assert tiny.json()["choices"][0]["message"]["content"] == plain


def test_a_tiny_temperature_in_a_batched_decode_step_leaves_the_scheduler_running(engine, client):
    """The reported wedge: the sampling error was raised in a batched decode step, outside the
    per-sequence error handling, and killed the stepping thread."""
    before = _generate(client, GENERATE).json()["text"]
    results: list = [None] * 4

    def ask(i: int) -> None:
        body = _with_sampling(max_tokens=12, temperature=1.058e-37 if i % 2 else 0.0, seed=1)
        results[i] = _generate(client, body, stream=bool(i % 2))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None and r.status_code == 200 for r in results), [r and r.text for r in results]
    assert engine.scheduler.failure is None and engine.scheduler._thread.is_alive()
    assert client.get("/health").status_code == 200
    assert _generate(client, GENERATE).json()["text"] == before


# --- policies -------------------------------------------------------------------------------------
REFUSED_POLICIES = ["cacheblend:", "cacheblend::gradual", "cacheblend:\u0660.\u0661", "cacheblend:0.1\u0661",
                    "epic:99999999999", "epic:1e3", "prophet:0.1:probe99999", "prophet:0.1:probe\u0663",
                    "cacheblend:0.15:temp1e-300", "cacheblend:0.15:temp0", "reuse:temp1e-37", "reuse:temp100",
                    "cacheblend:0.15:temp1.1e", "cacheblend: 0.1", "cacheblend:1_0", "cacheblend:0x1",
                    "cachecraft:1e9", "cacheblend:0.15:", "reuse:", "epic:+3"]


@pytest.mark.parametrize("spec", REFUSED_POLICIES)
def test_the_policy_grammar_refuses_empty_fields_non_ascii_numbers_and_values_out_of_range(spec):
    with pytest.raises(PolicySpecError):
        parse_policy_spec(spec)


@pytest.mark.parametrize("spec", ["cacheblend:0.1", "cacheblend:.5", "cacheblend:1e-1", "epic:65536",
                                  "prophet:0.1:probe1024", "cacheblend:0.15:temp0.05", "reuse:temp20",
                                  "cacheblend:0.15:temp1.05", "cachecraft:100"])
def test_the_documented_ranges_are_accepted_at_their_edges(spec):
    parse_policy_spec(spec)


@pytest.mark.parametrize("spec", REFUSED_POLICIES[:6] + ["cacheblend:0.15:temp1e-300"])
def test_a_refused_policy_is_a_422_naming_the_field(client, spec):
    response = _generate(client, GENERATE, policy=spec)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "policy"


@pytest.mark.parametrize("spec", ["\n", "cacheblend:0.1\t", "epic:\x00", "x\r\ny", "cacheblend:\u2028"])
def test_a_refused_policy_message_stays_one_line_whatever_was_sent(client, spec):
    response = _generate(client, GENERATE, policy=spec)
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert not any(not c.isprintable() for c in message), message


def test_a_tiny_attention_temperature_cannot_poison_a_tenant(client, engine):
    """The reported poisoning: `temp1e-300` on a fused chunk stored NaN KV under the victim's
    tenant, and every later request of that tenant answered empty."""
    victim = {"X-RagCache-Tenant": "victim"}
    other = {"prompt": {"chunks": ["Paris is the capital of France."], "question": "What is the capital of France?"},
             "sampling": {"max_tokens": 6}}
    baseline = _generate(client, other, policy="full").json()["text"]
    warm = client.post("/v1/chunks/warm", json={"chunks": [PASSAGE]}, headers={**AUTH, **victim})
    assert warm.status_code == 200, warm.text
    attack = _generate(client, GENERATE, victim, policy="cacheblend:0.15:temp1e-300")
    assert attack.status_code == 422, attack.text
    after = _generate(client, other, victim)
    assert after.status_code == 200 and after.json()["text"], after.text
    assert _generate(client, other, victim, policy="cacheblend:1.0").json()["text"] == baseline
    for digest, entry in engine.cache.store.ram.items():
        assert torch.isfinite(entry.keys).all() and torch.isfinite(entry.values).all(), digest


# --- the store never holds non-finite KV ---------------------------------------------------------
def _entry(bad: float | None = None) -> ChunkKV:
    keys, values = torch.randn(3, 5, 2, 16), torch.randn(3, 5, 2, 16)
    if bad is not None:
        values[1, 2, 0, 3] = bad
    return ChunkKV(keys, values, torch.arange(5), "c-1", "t")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_store_refuses_non_finite_kv_in_every_tier(tiny_engine, bad):
    store = tiny_engine.cache.store
    key = tiny_engine.cache.keys.for_tokens([1, 2, 3, 4, 5], "t", "isolated")
    with pytest.raises(NonFiniteKVError):
        store.put(key, _entry(bad))
    store.flush()
    assert not store.contains(key) and store.get(key) is None
    assert store.refused_non_finite == 1


def test_a_non_finite_file_on_disk_is_a_miss_and_deleted(tiny_engine, monkeypatch):
    """KV written intact but holding NaN (a store without this guard wrote such files) must
    never be read back: it counts as a damaged file, whole or read layer by layer."""
    import engine_sidecar.store.chunk_store as chunk_store
    import engine_sidecar.store.disk as disk

    store = tiny_engine.cache.store
    keys = [tiny_engine.cache.keys.for_tokens([i, 2, 3], "t", "isolated") for i in range(2)]
    with monkeypatch.context() as m:  # the guards of an older writer: none
        m.setattr(chunk_store, "finite_kv_flag", lambda *_: torch.tensor(True))
        m.setattr(disk, "finite_kv", lambda *_: True)
        for key in keys:
            store.put(key, _entry(float("nan")))
        store.flush()
    for key in keys:
        store.ram.remove(key.digest)
    assert store.get(keys[0]) is None  # read whole
    lazy = store.get(keys[1], lazy=True)  # read a layer at a time, as prefetch does
    assert lazy is not None and lazy.reader is not None
    with pytest.raises(disk.DamagedCacheFile):
        lazy.reader.read_into(lazy)
    assert store.disk.counters.corrupt_files == 2
    assert not any(key.digest in store.disk for key in keys)


@pytest.fixture(scope="module")
def nan_model_dir(tmp_path_factory, smol_dir):
    """A tiny model whose final norm is NaN: every logit it produces is NaN."""
    folder = make_tiny_model(tmp_path_factory.mktemp("nan-model"), "llama", tokenizer_from=smol_dir)
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("policy", ["cacheblend", "full"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_fail_the_request_with_a_422_and_store_nothing(nan_model_dir, tmp_path, policy, temperature):
    engine = Engine.from_pretrained(nan_model_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv")
    try:
        with TestClient(create_app(engine), raise_server_exceptions=False) as client:
            body = _with_sampling(temperature=temperature, seed=1)
            for stream in (False, True):
                response = client.post("/v1/generate", json={**body, "policy": policy, "stream": stream})
                assert response.status_code == 422, response.text
                assert "non-finite" in response.json()["error"]["message"]
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 3, "temperature": temperature})
            assert chat.status_code == 422, chat.text
            assert client.get("/health").status_code == 200
        engine.cache.store.flush()
        assert len(engine.cache.store.ram) == 0 and len(engine.cache.store.disk) == 0
        assert len(engine.cache.conversations) == 0
    finally:
        engine.close()


def test_warming_with_non_finite_kv_is_a_422_and_stores_nothing(tmp_path, smol_dir):
    # final-norm NaN leaves the KV finite; NaN in layer 0's input norm makes the KV itself NaN
    folder = make_tiny_model(tmp_path / "nan-kv", "llama", tokenizer_from=smol_dir)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float32", cache_dir=tmp_path / "kv")
    try:
        with TestClient(create_app(engine), raise_server_exceptions=False) as client:
            warm = client.post("/v1/chunks/warm", json={"chunks": [PASSAGE]})
            assert warm.status_code == 422, warm.text
            answer = client.post("/v1/generate", json={**GENERATE, "prompt": {**GENERATE["prompt"],
                                                                             "conversation_id": "c1"}})
            assert answer.status_code == 422, answer.text
        engine.cache.store.flush()
        assert len(engine.cache.store.ram) == 0 and len(engine.cache.store.disk) == 0 and len(engine.cache.conversations) == 0
    finally:
        engine.close()


# --- the scheduler survives any one sequence ------------------------------------------------------
def test_a_sequence_failing_in_a_decode_step_fails_alone(engine, client, monkeypatch):
    from engine_sidecar.engine.sequence import Sequence

    real = Sequence.accept_token
    calls = {"seed 7": 0}

    def fails_for_seed_7(self, token):
        if self.sampling.seed == 7:
            calls["seed 7"] += 1
            if calls["seed 7"] == 2:  # in a decode step: its first token came from the prefill
                raise RuntimeError("this sequence's own fault")
        return real(self, token)

    expected = _generate(client, _with_sampling(max_tokens=10)).json()["text"]
    monkeypatch.setattr(Sequence, "accept_token", fails_for_seed_7)
    results: dict[str, object] = {}

    def ask(name: str, body: dict) -> None:
        results[name] = _generate(client, body)

    threads = [threading.Thread(target=ask, args=("bad", _with_sampling(max_tokens=10, temperature=0.5, seed=7))),
               threading.Thread(target=ask, args=("good", _with_sampling(max_tokens=10)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results["good"].status_code == 200 and results["good"].json()["text"] == expected
    assert calls["seed 7"] == 2
    assert results["bad"].status_code == 500  # an engine fault (not the client's), answered, not hung
    assert engine.scheduler.failure is None
    assert client.get("/health").status_code == 200


def test_a_dead_scheduler_fails_what_waits_refuses_new_work_and_health_says_so(tiny_llama_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", disk=False)
    try:
        with TestClient(create_app(engine, ServerSettings(request_timeout_s=60)),
                        raise_server_exceptions=False) as client:
            assert client.post("/v1/generate", json=GENERATE).status_code == 200

            def broken_admit():  # a fault in the loop itself, outside any one sequence
                raise RuntimeError("scheduler bug")

            engine.scheduler._admit = broken_admit  # type: ignore[method-assign]
            failed = client.post("/v1/generate", json=GENERATE)
            assert failed.status_code == 503, failed.text
            assert "scheduler stopped" in failed.json()["error"]["message"]
            health = client.get("/health")
            assert health.status_code == 503 and "scheduler bug" in health.json()["error"]["message"]
            refused = client.post("/v1/generate", json=GENERATE)
            assert refused.status_code == 503, refused.text
    finally:
        closer = threading.Thread(target=engine.close)
        closer.start()
        closer.join(timeout=60)
        assert not closer.is_alive(), "close must complete after the scheduler died"


# --- auth before the body; schema pages behind the key ------------------------------------------
@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc", "/v1/cache/stats", "/no-such-page"])
def test_every_page_but_health_and_metrics_needs_the_key(client, path):
    response = client.get(path)
    assert response.status_code == 401, (path, response.text)
    assert response.headers["www-authenticate"] == "Bearer"
    assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    if path != "/no-such-page":
        assert client.get(path, headers=AUTH).status_code == 200
        assert client.get(path, headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_health_and_metrics_stay_open(client):
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("body", [b"{not json", b"[" * 5000 + b"]" * 5000, json.dumps(GENERATE).encode()])
def test_a_body_without_the_key_is_never_parsed(client, body):
    response = client.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"


# --- validation parity between routes -------------------------------------------------------------
def test_the_verbatim_layout_refuses_unknown_roles(client):
    body = {"prompt": {"messages": [{"role": "wizard", "content": PASSAGE}], "chunks": [PASSAGE]},
            "sampling": {"max_tokens": 2}}
    response = _generate(client, body)
    assert response.status_code == 422, response.text
    assert "wizard" in response.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}, headers=AUTH)
    assert chat.status_code == 422


def test_a_conversation_id_has_the_same_cap_on_both_routes(client):
    long_id = "x" * (1 << 20)
    body = {**GENERATE, "prompt": {**GENERATE["prompt"], "conversation_id": long_id}}
    assert _generate(client, body).status_code == 422
    chat = {"messages": [{"role": "user", "content": "q"}], "chunks": [PASSAGE], "conversation_id": long_id}
    assert client.post("/v1/chat/completions", json=chat, headers=AUTH).status_code == 422


@pytest.mark.parametrize("ids,status", [([-1], 422), ([1180591620717411303424], 422), ([2**31], 422),
                                        ([49152], 400), ([2, 49151], 200)])
def test_stop_token_ids_must_be_in_the_vocabulary(client, ids, status):
    response = _generate(client, _with_sampling(stop_token_ids=ids))
    assert response.status_code == status, response.text
    if status != 200:
        assert "stop_token_ids" in response.json()["error"]["message"] + str(response.json()["error"]["field"])
