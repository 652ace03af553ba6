"""The sample chatbot's web page end to end: real Qdrant local mode, real MiniLM, a real sidecar
process running SmolLM2, the page's SSE API, and the page itself in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx
import pytest

from engine_sidecar.server.process import ServiceProcess
from examples.chatbot import ingest
from examples.chatbot.browser import chromium_path, drive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCS = {
    "nile.txt": "The Nile is a river in Africa. It flows north through Egypt into the Mediterranean Sea.",
    "fuji.txt": "Mount Fuji is the highest mountain in Japan, 3,776 metres high, near Tokyo.",
    "reef.txt": "The Great Barrier Reef is the largest coral reef system, off Queensland, Australia.",
}


class ChatbotProcess(ServiceProcess):
    banner_pattern = re.compile(r"ragcache chatbot on (http://\S+)")
    health_path = "/api/info"
    what = "the chatbot page"


@pytest.fixture(scope="module")
def chatbot(tmp_path_factory, smol_dir):
    docs, qdrant = tmp_path_factory.mktemp("docs"), tmp_path_factory.mktemp("qdrant")
    for name, text in DOCS.items():
        (docs / name).write_text(text, encoding="utf-8")
    assert ingest.main(["--docs", str(docs), "--qdrant-path", str(qdrant)]) == 0
    log = tmp_path_factory.mktemp("logs") / "web.log"
    args = [sys.executable, "-m", "examples.chatbot.web", "--port", "0", "--qdrant-path", str(qdrant), "--no-ingest",
            "--model", str(smol_dir), "--sidecar-arg=--no-disk", "--k", "2", "--max-tokens", "16"]
    with ChatbotProcess(args, log, cwd=ROOT) as server:
        yield server


def sse_events(base: str, conversation_id: str, question: str) -> list[tuple[str, dict]]:
    events = []
    with httpx.stream("POST", base + "/api/chat", json={"conversation_id": conversation_id, "question": question},
                      timeout=300) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        for line in resp.iter_lines():
            if line.startswith("event: "):
                block["event"] = line[7:]
            elif line.startswith("data: "):
                events.append((block.pop("event"), json.loads(line[6:])))
    return events


def test_sse_turns_stream_sources_answer_and_reuse(chatbot):
    first = sse_events(chatbot.base, "api-test", "Where does the Nile flow?")
    kinds = [k for k, _ in first]
    assert kinds[0] == "sources" and kinds[-1] == "stats" and kinds.count("delta") > 1
    assert first[0][1]["sources"][0]["id"] == "nile.txt:0"
    stats = first[-1][1]
    assert stats["turn"] == 1 and stats["prefill_tokens"] > 0 and stats["full_prefill_basis"] == "estimated"
    assert stats["full_prefill_s"] > 0
    follow_up = sse_events(chatbot.base, "api-test", "Which sea does it reach?")
    assert follow_up[-1][0] == "stats" and follow_up[-1][1]["turn"] == 2
    assert follow_up[-1][1]["tokens_reused"] > 0  # continues from turn 1's KV


def test_a_follow_up_is_retrieved_with_the_questions_before_it(chatbot):
    sse_events(chatbot.base, "follow-up", "Tell me about the Great Barrier Reef.")
    follow_up = sse_events(chatbot.base, "follow-up", "Where is it?")
    sources = follow_up[0][1]
    assert sources["query"] == "Tell me about the Great Barrier Reef. Where is it?"
    assert sources["sources"][0]["id"] == "reef.txt:0"  # "Where is it?" alone names no topic


def test_an_answer_cut_at_the_length_limit_says_so(chatbot):
    stats = sse_events(chatbot.base, "long-answer", "Describe the Nile, Mount Fuji and the reef in detail.")[-1][1]
    assert stats["finish_reason"] in ("length", "stop")
    assert (stats["finish_reason"] == "length") == (stats["decode_tokens"] >= 16)  # --max-tokens 16
    assert "min ago" in stats["full_prefill_note"]


def test_bad_requests_are_refused_with_a_reason(chatbot):
    bad_id = httpx.post(chatbot.base + "/api/chat", json={"conversation_id": "no spaces!", "question": "hi"})
    assert bad_id.status_code == 422 and "conversation_id" in bad_id.text
    blank = httpx.post(chatbot.base + "/api/chat", json={"conversation_id": "c1", "question": "   "})
    assert blank.status_code == 400 and "empty" in blank.text


def test_page_in_headless_chromium(chatbot, tmp_path):
    if chromium_path() is None:
        if os.environ.get("RAGCACHE_REQUIRE_BROWSER"):
            pytest.fail("RAGCACHE_REQUIRE_BROWSER is set but Debian's chromium is not installed")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    shot = tmp_path / "chatbot.png"
    first, second = drive(chatbot.base + "/", ["Where does the Nile flow?", "Which sea does it reach?"], shot)
    assert not first.error and not second.error
    assert first.answer.strip() and first.deltas > 1  # streamed in pieces, not one block
    assert "nile.txt:0" in first.sources
    assert "TTFT" in first.numbers and "reused" in second.numbers
    assert second.answer.strip() and second.tokens_reused > 0
    for view in (first, second):  # a cut answer is marked, a finished one is not
        assert view.cut == view.answer.endswith("[cut at the length limit]")
    assert shot.stat().st_size > 10_000


def test_unreachable_sidecar_is_a_one_line_error(tmp_path):
    import subprocess

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(DOCS["nile.txt"], encoding="utf-8")
    assert ingest.main(["--docs", str(docs), "--qdrant-path", str(tmp_path / "q")]) == 0
    proc = subprocess.run([sys.executable, "-m", "examples.chatbot.web", "--base-url", "http://127.0.0.1:9",
                           "--qdrant-path", str(tmp_path / "q"), "--no-ingest", "--port", "0"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("chatbot: error: the engine did not answer")
