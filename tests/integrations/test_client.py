"""Client behaviour that a healthy server never shows: retries, backoff, error mapping, broken
connections. The peer is a scripted stdlib HTTP server (it plays back canned responses; no
engine is involved). End-to-end client use against `ragcache serve` is in test_server.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragcache_integrations.client import (
    APIConnectionError,
    APITimeoutError,
    AsyncRagCacheClient,
    AuthenticationError,
    InvalidRequestError,
    RagCacheClient,
    RateLimitError,
    ServerError,
)

HEALTH = {"status": "ok", "model": "m", "model_path": "/m", "context_window": 8, "device": "cpu", "dtype": "float32",
          "queue_depth": 0, "max_queue": 1}
# one reply: (status, headers, body) or "drop" (close the connection without answering) or
# ("sleep", seconds)
Reply = tuple[int, dict[str, str], bytes] | str | tuple[str, float]


def _json(status: int, body: object, **headers: str) -> Reply:
    return status, {"content-type": "application/json", **headers}, json.dumps(body).encode()


def error_reply(status: int, message: str, field: str | None = None, **headers: str) -> Reply:
    return _json(status, {"error": {"message": message, "type": "x", "field": field, "code": "c"}}, **headers)


class Scripted:
    def __init__(self, replies: list[Reply], port: int = 0):
        self.replies, self.requests = list(replies), []
        script = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                script.requests.append((self.command, self.path, dict(self.headers), self.rfile.read(length)))
                reply = script.replies.pop(0) if script.replies else _json(200, HEALTH)
                if reply == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(reply[0], str):  # ("sleep", s)
                    time.sleep(reply[1])
                    reply = _json(200, HEALTH)
                status, headers, body = reply
                self.send_response(status)
                for k, v in {**headers, "content-length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _reply

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Scripted:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_fails_at_once_naming_the_address(monkeypatch):
    address = f"http://127.0.0.1:{_free_port()}"
    client = RagCacheClient(address, retries=5, backoff_s=30)
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail(f"slept {s} s before failing: refused is not retried"))
    with pytest.raises(APIConnectionError, match="is `ragcache serve` running at that address") as caught:
        client.health()
    assert address in str(caught.value)


def test_a_server_that_comes_up_later_is_reached_by_the_next_call():
    port = _free_port()
    client = RagCacheClient(f"http://127.0.0.1:{port}", retries=0)
    with pytest.raises(APIConnectionError):
        client.health()
    with Scripted([], port=port):
        assert client.health().status == "ok"


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_an_openai_style_base_url_reaches_the_sidecar(suffix):
    with Scripted([]) as peer:
        assert RagCacheClient(peer.base + suffix, retries=0).health().status == "ok"
    assert peer.requests[0][1] == "/health"


def test_a_404_from_another_server_asks_whether_it_is_a_sidecar():
    with Scripted([(404, {"content-type": "text/plain"}, b"Not Found")]) as peer:
        with pytest.raises(InvalidRequestError, match="is this a ragcache sidecar"):
            RagCacheClient(peer.base, retries=0).health()


def test_429_and_503_are_retried_after_retry_after():
    with Scripted([error_reply(429, "full", **{"retry-after": "0"}), error_reply(503, "busy"),
                   _json(200, HEALTH)]) as peer:
        assert RagCacheClient(peer.base, retries=3, backoff_s=0.01).health().status == "ok"
        assert len(peer.requests) == 3


def test_429_past_the_retries_is_a_rate_limit_error():
    with Scripted([error_reply(429, "queue full", **{"retry-after": "0"})] * 3) as peer:
        with pytest.raises(RateLimitError, match="queue full") as info:
            RagCacheClient(peer.base, retries=2, backoff_s=0.01).health()
        assert info.value.status == 429 and len(peer.requests) == 3


@pytest.mark.parametrize("reply,kind,status,field", [
    (error_reply(422, "sampling.max_tokens: too big", "sampling.max_tokens"), InvalidRequestError, 422,
     "sampling.max_tokens"),
    (error_reply(413, "limit is 6", "prompt.chunks"), InvalidRequestError, 413, "prompt.chunks"),
    (error_reply(401, "wrong key", "authorization"), AuthenticationError, 401, "authorization"),
    (error_reply(504, "too slow"), ServerError, 504, None),
    ((502, {"content-type": "text/html"}, b"<h1>Bad gateway</h1>"), ServerError, 502, None),
])
def test_errors_are_typed_and_carry_the_servers_message(reply, kind, status, field):
    with Scripted([reply]) as peer:
        with pytest.raises(kind) as info:
            RagCacheClient(peer.base, retries=0).generate({"question": "q"})
    assert info.value.status == status and info.value.field == field
    assert info.value.message in ("sampling.max_tokens: too big", "limit is 6", "wrong key", "too slow",
                                  "<h1>Bad gateway</h1>")


def test_a_request_the_server_may_have_started_is_not_retried():
    with Scripted(["drop"]) as peer:
        with pytest.raises(APIConnectionError):
            RagCacheClient(peer.base, retries=3, backoff_s=0.01).generate({"question": "q"})
        assert len(peer.requests) == 1


def test_client_timeout_is_typed():
    with Scripted([("sleep", 1.0)]) as peer:
        with pytest.raises(APITimeoutError):
            RagCacheClient(peer.base, timeout=0.2, retries=0).health()


def _sse(*events: dict, event: str | None = None) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)


def test_stream_yields_deltas_keeps_the_result_and_raises_stream_errors():
    done = {"type": "done", "text": "ab", "token_ids": [1, 2], "finish_reason": "length", "stats": {},
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    ok = (200, {"content-type": "text/event-stream"},
          _sse({"type": "delta", "text": "a"}, {"type": "delta", "text": "b"}, done))
    failing = (200, {"content-type": "text/event-stream"},
               _sse({"type": "delta", "text": "a"}, {"type": "error", "status": 504,
                                                     "error": {"message": "late", "code": "timeout"}}))
    with Scripted([ok, failing]) as peer:
        client = RagCacheClient(peer.base, retries=0, tenant="acme")
        assert list(client.stream({"question": "q"})) == ["a", "b"]
        assert client.last_result is not None and client.last_result.usage.total_tokens == 5
        deltas: Iterator[str] = client.stream({"question": "q"}, tenant="other")
        with pytest.raises(ServerError, match="late") as info:
            list(deltas)
        assert info.value.status == 504 and info.value.code == "timeout"
        sent = [json.loads(r[3]) for r in peer.requests]
        assert all(body["stream"] is True for body in sent)
        # the client-wide tenant travels as the header; a per-call tenant replaces it
        assert [r[2].get("X-RagCache-Tenant") for r in peer.requests] == ["acme", "other"]


def test_stream_chat_assembles_text_stats_and_usage_and_raises_stream_errors():
    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}

    ok = (200, {"content-type": "text/event-stream"},
          _sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "Hi"}), chunk({"content": "!"}),
               chunk({}, "length", ragcache={"prefill_tokens_total": 7, "decode_tokens": 2}),
               {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}) + b"data: [DONE]\n\n")
    failing = (200, {"content-type": "text/event-stream"},
               _sse(chunk({"content": "Hi"}), {"error": {"message": "late", "type": "timeout_error"}}))
    with Scripted([ok, failing]) as peer:
        client = RagCacheClient(peer.base, retries=0)
        assert list(client.stream_chat([{"role": "user", "content": "q"}], chunks=["c"], max_tokens=2)) == ["Hi", "!"]
        result = client.last_result
        assert result is not None and result.text == "Hi!" and result.finish_reason == "length"
        assert result.stats.prefill_tokens_total == 7 and result.usage.total_tokens == 9
        with pytest.raises(ServerError, match="late") as info:
            list(client.stream_chat([{"role": "user", "content": "q"}]))
        assert info.value.status == 504
        body = json.loads(peer.requests[0][3])
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["chunks"] == ["c"] and body["max_tokens"] == 2


def test_async_client_retries_and_maps_errors_the_same_way():
    async def run() -> None:
        with Scripted([error_reply(429, "full", **{"retry-after": "0"}), _json(200, HEALTH),
                       error_reply(422, "bad", "policy")]) as peer:
            async with AsyncRagCacheClient(peer.base, retries=2, backoff_s=0.01) as client:
                assert (await client.health()).status == "ok"
                with pytest.raises(InvalidRequestError) as info:
                    await client.generate({"question": "q"}, policy="x")
                assert info.value.field == "policy"

    asyncio.run(run())
