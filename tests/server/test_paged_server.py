"""`ragcache serve --kv-block-size`: a real sidecar whose requests decode from the block pool,
its blocks on /metrics, and a request the pool can never hold answered 413 (too long), not 500."""

from __future__ import annotations

import httpx
import pytest

from ragcache_integrations.client import RagCacheClient
from ragcache_integrations.types import ChunkedPrompt
from tests.server.test_server_process import ServerProcess

PASSAGES = ["Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
            "The Danube passes through ten countries, more than any other river in the world."]


@pytest.fixture(scope="module")
def server(smol_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("paged-server")
    # 16 MiB of blocks: SmolLM2 fp32 rows are 46 KB, so about 360 rows
    with ServerProcess(smol_dir, root / "kv", root / "serve.log", "--kv-block-size", "16", "--batch-kv-gb",
                       str(16 / 1024), "--threads", "2") as proc:
        yield proc


def test_requests_decode_from_the_pool_and_its_blocks_are_on_metrics(server):
    with RagCacheClient(server.base) as client:
        result = client.generate(ChunkedPrompt(chunks=PASSAGES, question="Which is the highest?"), {"max_tokens": 8})
    assert result.token_ids
    total = server.metric("ragcache_kv_blocks", kind="total")
    assert total > 0 and server.metric("ragcache_kv_blocks", kind="used") == 0


def test_a_request_the_pool_cannot_hold_is_a_413_naming_the_flag(server):
    body = {"prompt": {"chunks": PASSAGES, "question": "Which is the highest?"}, "sampling": {"max_tokens": 4000}}
    response = httpx.post(server.base + "/v1/generate", json=body, timeout=60)
    assert response.status_code == 413, response.text
    assert "--batch-kv-gb" in response.text
