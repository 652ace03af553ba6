"""Chatbot ingest: stable chunk ids, idempotent re-ingest into real Qdrant local mode with real
MiniLM embeddings, the --qdrant-url path, and one-line errors for user mistakes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.chatbot import ingest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def minilm():
    return ingest.embedder()


def test_split_text_offsets_index_into_the_text():
    text = "alpha beta gamma\n\ndelta epsilon\n\nzeta eta theta iota"
    chunks = list(ingest.split_text("doc", text, max_words=4))
    assert [c.chunk_id for c in chunks] == [f"doc:{c.offset}" for c in chunks]
    for c in chunks:
        assert text[c.offset : c.offset + len(c.text)] == c.text
    assert " ".join(c.text for c in chunks).split() == text.split()
    assert [c.point_id for c in chunks] == [c.point_id for c in ingest.split_text("doc", text, max_words=4)]


def test_reingest_is_idempotent_and_picks_up_edits(tmp_path, minilm):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Oslo is the capital of Norway.\n\nBergen is on the west coast.", encoding="utf-8")
    (docs / "b.md").write_text("Helsinki is the capital of Finland.", encoding="utf-8")
    chunks = ingest.chunk_documents(ingest.load_documents(docs), max_words=6)
    client = ingest.open_qdrant(tmp_path / "q")
    try:
        first = ingest.ingest(client, chunks, minilm, progress=False)
        second = ingest.ingest(client, chunks, minilm, progress=False)
        assert first == second == len(chunks) == 3
        (docs / "b.md").write_text("Helsinki is the capital of Finland, on the Gulf of Finland.", encoding="utf-8")
        edited = ingest.chunk_documents(ingest.load_documents(docs), max_words=6)
        assert ingest.ingest(client, edited, minilm, progress=False) == 3  # same ids: overwritten in place
        points, _ = client.scroll(ingest.COLLECTION, limit=10, with_payload=True)
        texts = {p.payload["chunk_id"]: p.payload["text"] for p in points}
        assert texts["b.md:0"].endswith("Gulf of Finland.")
        assert set(texts) == {"a.txt:0", "a.txt:32", "b.md:0"}
    finally:
        client.close()


def test_qdrant_url_path_with_qdrants_own_client(minilm):
    # No Qdrant server can be installed here (it is not on PyPI or Debian); ':memory:' is a
    # location Qdrant's client accepts in place of a URL, so the --qdrant-url branch runs for real.
    client = ingest.open_qdrant(qdrant_url=":memory:")
    try:
        chunks = list(ingest.split_text("nile", "The Nile flows north into the Mediterranean Sea."))
        assert ingest.ingest(client, chunks, minilm, progress=False) == 1
        vector = minilm.encode(["Where does the Nile go?"], normalize_embeddings=True)[0].tolist()
        hit = client.query_points(ingest.COLLECTION, query=vector, limit=1).points[0]
        assert hit.payload["chunk_id"] == "nile:0"
    finally:
        client.close()


def run_ingest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "examples.chatbot.ingest", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_unreachable_server_and_held_folder_are_one_line_errors(tmp_path):
    down = run_ingest("--corpus", str(ROOT / "examples" / "data" / "demo.json"), "--qdrant-url", "http://127.0.0.1:9")
    assert down.returncode != 0 and "Traceback" not in down.stderr
    assert "does not answer" in down.stderr.strip().splitlines()[-1]
    held = ingest.open_qdrant(tmp_path / "q")
    try:
        busy = run_ingest("--corpus", str(ROOT / "examples" / "data" / "demo.json"), "--qdrant-path", str(tmp_path / "q"))
    finally:
        held.close()
    assert busy.returncode != 0 and "Traceback" not in busy.stderr
    assert "in use by another process" in busy.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("content", ["not json", json.dumps({"x": 1}), json.dumps([{"ctxs": []}])])
def test_bad_corpus_files_are_one_line_errors(tmp_path, content):
    bad = tmp_path / "corpus.json"
    bad.write_text(content, encoding="utf-8")
    result = run_ingest("--corpus", str(bad), "--qdrant-path", str(tmp_path / "q"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("ingest: error:")


def test_warm_on_a_running_sidecar_after_neighbours_prints_the_cost(tmp_path, tiny_llama_dir):
    from engine_sidecar.server.process import SidecarProcess
    from ragcache_integrations import ChunkedPrompt, RagCacheClient

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "rivers.txt").write_text("The Rhine flows from the Alps to the North Sea.\n\n"
                                     "The Rhone flows from the Alps to the Mediterranean.\n\n"
                                     "Basalt is a dark volcanic rock.", encoding="utf-8")
    with SidecarProcess(tmp_path / "sidecar.log", "--model", str(tiny_llama_dir), "--no-disk") as sidecar:
        args = ("--docs", str(docs), "--max-words", "10", "--qdrant-path", str(tmp_path / "q"), "--warm", sidecar.base)
        first = run_ingest(*args)
        assert first.returncode == 0, first.stderr
        summary = first.stdout.strip().splitlines()[-1]
        assert summary.startswith("warmed 3 of 3 chunks on the sidecar (after their 2 nearest passages")
        assert "tokens prefilled in" in summary
        again = run_ingest(*args)
        assert again.returncode == 0 and "warmed 0 of 3 chunks" in again.stdout, again.stderr
        # the chat asks with the ingested chunks: every one is found
        chunks = ingest.chunk_documents(ingest.load_documents(docs), max_words=10)
        from examples.chatbot.chat import SYSTEM
        from ragcache_integrations import Chunk

        with RagCacheClient(sidecar.base) as client:
            prompt = ChunkedPrompt(chunks=[Chunk(text=c.text, id=c.chunk_id) for c in chunks[::-1]],
                                   question="Where does the Rhine end?", system=SYSTEM)
            stats = client.generate(prompt, {"max_tokens": 2}).stats
        assert (stats.chunk_hits, stats.chunk_misses) == (3, 0)
    down = run_ingest("--docs", str(docs), "--qdrant-path", str(tmp_path / "q2"), "--warm", "http://127.0.0.1:9")
    assert down.returncode != 0 and "Traceback" not in down.stderr
    assert down.stderr.strip().splitlines()[-1].startswith("ingest: error: warming on http://127.0.0.1:9 failed")
    bad = run_ingest("--docs", str(docs), "--qdrant-path", str(tmp_path / "q3"), "--neighbours", "9")
    assert bad.returncode != 0 and "--neighbours must be 0 to 8" in bad.stderr
