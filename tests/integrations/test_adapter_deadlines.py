"""`timeout` is one deadline for a whole call, on the clients and on every adapter, streamed or
not: a call whose answer would take far longer fails with APITimeoutError soon after `timeout`
seconds, naming it, and the sidecar stops generating (it sees the connection close). Against a
real `ragcache serve` with SmolLM2; scripted peers play a server that goes quiet in the middle
of a stream and one that asks for a retry later than the deadline allows."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage

from ragcache_integrations.client import APITimeoutError, AsyncRagCacheClient, RagCacheClient, RateLimitError
from ragcache_integrations.langchain import ChunkCachedChatModel, ChunkCachedRunnable
from ragcache_integrations.llama_index import ChunkCachedLLM
from tests.integrations.test_client import Scripted, error_reply
from tests.server.test_server_process import ServerProcess

TIMEOUT = 2.0
QUESTION = "Count from one to one thousand, one number per line."
PROMPT = {"question": QUESTION}


@pytest.fixture(scope="module")
def sidecar(smol_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("deadlines")
    with ServerProcess(smol_dir, root / "kv", root / "serve.log", "--threads", "2") as proc:
        yield proc


@pytest.fixture(scope="module")
def answer_tokens(sidecar) -> int:
    """max_tokens of an answer that takes at least ten timeouts to decode on this machine (never
    under 300 tokens; ignore_eos makes the engine decode all of them)."""
    with RagCacheClient(sidecar.base) as client:
        client.generate(PROMPT, {"max_tokens": 4})  # the first call pays for warm-up, not the measure
        stamps = [time.monotonic() for _ in client.stream(PROMPT, {"max_tokens": 48, "ignore_eos": True})]
        decoded = client.last_result.stats.decode_tokens
    seconds_per_token = (stamps[-1] - stamps[0]) / (decoded - 1)
    return min(4096, max(300, math.ceil(10 * TIMEOUT / seconds_per_token)))


def _disconnected(sidecar) -> float:
    return sidecar.metric("ragcache_engine_jobs_total", endpoint="generate", outcome="disconnected")


def _assert_the_sidecar_stopped(sidecar, before: float) -> None:
    """The sidecar saw the client leave and stopped decoding (it notices at its next token)."""
    for _ in range(300):
        if _disconnected(sidecar) > before:
            return
        time.sleep(0.1)
    raise AssertionError("the sidecar kept generating after the client's deadline")


# --- each way to ask for an answer, streamed or not, through every client and adapter ------------
def _sampling(tokens: int) -> dict[str, Any]:
    return {"max_tokens": tokens, "ignore_eos": True}


def _client_stream(base: str, tokens: int) -> None:
    with RagCacheClient(base, timeout=TIMEOUT, retries=0) as client:
        list(client.stream(PROMPT, _sampling(tokens)))


def _async_client_stream(base: str, tokens: int) -> None:
    async def run() -> None:
        async with AsyncRagCacheClient(base, timeout=TIMEOUT, retries=0) as client:
            [d async for d in client.stream(PROMPT, _sampling(tokens))]

    asyncio.run(run())


def _llm(base: str, tokens: int) -> ChunkCachedLLM:
    return ChunkCachedLLM(base_url=base, max_tokens=tokens, timeout=TIMEOUT, max_retries=0,
                          additional_kwargs={"ignore_eos": True})


def _chat_model(base: str, tokens: int) -> ChunkCachedChatModel:
    return ChunkCachedChatModel(base_url=base, max_tokens=tokens, timeout=TIMEOUT, max_retries=0,
                                model_kwargs={"ignore_eos": True})


def _drain_async(responses: Callable[[], Any]) -> None:
    async def run() -> None:
        [r async for r in await responses()]

    asyncio.run(run())


MESSAGES = [ChatMessage(role="user", content=QUESTION)]
CALLS: dict[str, Callable[[str, int], object]] = {
    "client.stream": _client_stream,
    "async_client.stream": _async_client_stream,
    "llama_index.complete": lambda base, n: _llm(base, n).complete(QUESTION),
    "llama_index.chat": lambda base, n: _llm(base, n).chat(MESSAGES),
    "llama_index.stream_complete": lambda base, n: list(_llm(base, n).stream_complete(QUESTION)),
    "llama_index.stream_chat": lambda base, n: list(_llm(base, n).stream_chat(MESSAGES)),
    "llama_index.acomplete": lambda base, n: asyncio.run(_llm(base, n).acomplete(QUESTION)),
    "llama_index.astream_chat": lambda base, n: _drain_async(lambda: _llm(base, n).astream_chat(MESSAGES)),
    "langchain_chat.invoke": lambda base, n: _chat_model(base, n).invoke(QUESTION),
    "langchain_chat.stream": lambda base, n: list(_chat_model(base, n).stream(QUESTION)),
    "langchain_chat.ainvoke": lambda base, n: asyncio.run(_chat_model(base, n).ainvoke(QUESTION)),
    "langchain_runnable.stream": lambda base, n: list(ChunkCachedRunnable(
        base_url=base, max_tokens=n, timeout=TIMEOUT, max_retries=0, additional_kwargs={"ignore_eos": True},
    ).stream({"question": QUESTION, "context": []})),
}


@pytest.mark.slow
@pytest.mark.parametrize("call", CALLS)
def test_timeout_is_a_deadline_for_the_whole_call(sidecar, answer_tokens, call):
    before = _disconnected(sidecar)
    start = time.monotonic()
    with pytest.raises(APITimeoutError, match=f"timeout={TIMEOUT:g} s"):
        CALLS[call](sidecar.base, answer_tokens)
    elapsed = time.monotonic() - start
    # the whole answer needs ten timeouts or more; the tokens kept coming all along, so only a
    # deadline on the whole call (not httpx's per-read timeout) can end it this early
    assert TIMEOUT <= elapsed < 4 * TIMEOUT
    _assert_the_sidecar_stopped(sidecar, before)


# --- scripted peers: a server that goes quiet, one that asks for a late retry -------------------
class QuietPeer:
    """Streams a delta event every 0.1 s for `talk_s` seconds, then sends nothing more."""

    def __init__(self, talk_s: float):
        self.hung_up = threading.Event()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                event = b'data: {"type": "delta", "text": "a"}\n\n'
                end = time.monotonic() + talk_s
                try:
                    while time.monotonic() < end:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        self.wfile.flush()
                        time.sleep(0.1)
                    # silent, until the client closes the connection (then the read sees its end)
                    while self.connection.recv(1):
                        pass
                except OSError:
                    pass
                peer.hung_up.set()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> QuietPeer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def _async_stream(base: str, timeout: float) -> None:
    async with AsyncRagCacheClient(base, timeout=timeout, retries=0) as client:
        [d async for d in client.stream(PROMPT)]


async def _async_generate(base: str, timeout: float, retries: int) -> None:
    async with AsyncRagCacheClient(base, timeout=timeout, retries=retries) as client:
        await client.generate(PROMPT)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stream_that_goes_quiet_ends_at_the_deadline(mode):
    # 3 s of tokens, then silence: a read timeout set when the request went out (4 s) would end
    # the wait at 7 s; the deadline ends it at 4 s
    deadline = 4.0
    with QuietPeer(talk_s=3.0) as peer:
        start = time.monotonic()
        with pytest.raises(APITimeoutError, match=f"timeout={deadline:g} s"):
            if mode == "sync":
                with RagCacheClient(peer.base, timeout=deadline, retries=0) as client:
                    list(client.stream(PROMPT))
            else:
                asyncio.run(_async_stream(peer.base, deadline))
        elapsed = time.monotonic() - start
        assert deadline <= elapsed < deadline + 1.5
        assert peer.hung_up.wait(10)  # the connection was closed: a real server would stop the work


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_retries_never_wait_past_the_deadline(mode):
    # each refusal asks for a retry in 5 s, past the 1.5 s deadline: the refusal is the answer now
    busy = error_reply(429, "the engine queue is full", **{"retry-after": "5"})
    with Scripted([busy] * 4) as peer:
        start = time.monotonic()
        with pytest.raises(RateLimitError, match="queue is full"):
            if mode == "sync":
                with RagCacheClient(peer.base, timeout=1.5, retries=3) as client:
                    client.generate(PROMPT)
            else:
                asyncio.run(_async_generate(peer.base, 1.5, retries=3))
        assert time.monotonic() - start < 1.5 and len(peer.requests) == 1
