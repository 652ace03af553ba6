"""Property-based fuzz of the sampling and policy fields against a real `ragcache serve`: extreme
floats (subnormals, 1e-300, NaN and infinities, which Python's JSON writes and reads), policy
strings built from the grammar's pieces with foreign digits and out-of-range numbers. No input may
give a 5xx, the server must stay healthy after every one, and at the end a fixed request gets the
answer it got before the fuzz (no input poisoned the cache)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragcache_integrations.policy_registry import NAMES
from tests.server.test_server_process import ServerProcess

PASSAGE = "Mount Fuji is 3,776 m high. The Nile flows north."
FIXED = {"prompt": {"chunks": [PASSAGE], "question": "How high is Mount Fuji?"}, "sampling": {"max_tokens": 6}}
EXTREMES = [0.0, 5e-324, 1e-323, 1e-300, 1.058e-37, 1e-38, 1e-6, 1e-5, 1.0, 5.0, 5.000001, -0.0, -1e-300,
            float("nan"), float("inf"), float("-inf"), 1e308]

floats = st.one_of(st.sampled_from(EXTREMES), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
                   st.floats(min_value=0.0, max_value=1e-30, allow_subnormal=True))
numbers = st.one_of(st.sampled_from(["0.15", "1", "16", "1e-300", "1e-37", "99999999999", "0", ".5", "1e3",
                                     "\u0660.\u0661", "\u0661", "0.1\u0663", "-1", "nan", "inf", "1_0", " 1", ""]),
                    floats.map(repr), st.integers(-10, 10**12).map(str))
tags = st.one_of(st.sampled_from(["gradual", "nowindow", "split", "nostop", "auto", ""]),
                 numbers.map(lambda n: "temp" + n), numbers.map(lambda n: "probe" + n))
policies = st.one_of(
    st.builds(lambda name, parts: ":".join([name, *parts]), st.sampled_from(NAMES),
              st.lists(st.one_of(numbers, tags), max_size=3)),
    st.text(max_size=20))


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampling-fuzz")
    with ServerProcess(tiny_llama_dir, folder / "kv", folder / "log", "--max-tokens", "6",
                       "--request-timeout", "60") as server:
        yield server
    assert "Traceback" not in server.log(), server.log_tail(60)


def _post(server, body: dict, path: str = "/v1/generate") -> httpx.Response:
    # json.dumps writes NaN and Infinity as bare words, as many clients do: the server must cope
    return httpx.post(server.base + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=60)


def _answer(server) -> str:
    response = _post(server, FIXED)
    assert response.status_code == 200, response.text
    return response.json()["text"]


@pytest.fixture(scope="module")
def before(server) -> str:
    return _answer(server)


def _check(server, response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and "\n" not in error["message"]
    assert httpx.get(server.base + "/health", timeout=30).status_code == 200


@given(temperature=floats, top_p=floats, seed=st.one_of(st.none(), st.integers(-1, 2**64)),
       stream=st.booleans(), chat=st.booleans())
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_sampling_value_gives_a_5xx_or_hurts_the_server(server, before, temperature, top_p, seed, stream, chat):
    if chat:
        body = {"messages": [{"role": "user", "content": "Hi"}], "chunks": [PASSAGE], "max_tokens": 4,
                "temperature": temperature, "top_p": top_p, "seed": seed, "stream": stream}
        response = _post(server, body, "/v1/chat/completions")
    else:
        sampling = {"max_tokens": 4, "temperature": temperature, "top_p": top_p, "seed": seed}
        response = _post(server, {**FIXED, "sampling": sampling, "stream": stream})
    _check(server, response)


@given(policy=policies)
@settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_policy_string_gives_a_5xx_or_poisons_the_cache(server, before, policy):
    response = _post(server, {**FIXED, "policy": policy, "sampling": {"max_tokens": 3}})
    _check(server, response)
    if response.status_code == 422:
        assert response.json()["error"]["field"] == "policy"


def test_after_the_fuzz_the_fixed_request_answers_as_before(server, before):
    assert _answer(server) == before
