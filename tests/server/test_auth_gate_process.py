"""Against a real `ragcache serve --api-key`: a client without the key gets its 401 and the
connection closes, so the server reads none of a huge declared body; HEAD /health answers as
load balancers probe it."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.test_server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    with ServerProcess(tiny_llama_dir, root / "kv", root / "log", "--api-key", "s3cret") as proc:
        yield proc.base


def _raw(base: str) -> socket.socket:
    url = urlparse(base)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def test_a_401_closes_the_connection_instead_of_reading_the_body(server):
    sock = _raw(server)
    head = (b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10737418240\r\n\r\n")  # 10 GiB declared
    sock.sendall(head + b"{" * 65536)
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 401") and b"connection: close" in reply.lower()
    # the server hung up: what we send next is never read, and the socket reaches its end
    sent, closed = 0, False
    for _ in range(2000):
        try:
            sock.sendall(b"{" * 65536)
            sent += 65536
        except OSError:  # reset by the peer
            closed = True
            break
        time.sleep(0.001)
    if not closed:
        sock.settimeout(10)
        try:
            while sock.recv(65536):
                pass
            closed = True
        except OSError:
            closed = True
    sock.close()
    assert closed and sent < 2000 * 65536


def test_a_request_without_a_body_keeps_its_connection(server):
    with httpx.Client(base_url=server) as client:
        refused = client.get("/v1/cache/stats")
        assert refused.status_code == 401 and "connection" not in {k.lower() for k in refused.headers}
        assert client.get("/health").status_code == 200  # same connection, still open


def test_head_health_answers_without_a_body(server):
    probe = httpx.head(server + "/health", timeout=30)
    assert probe.status_code == 200 and probe.content == b""
