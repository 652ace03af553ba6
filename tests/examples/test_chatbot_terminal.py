"""The sample chatbot's terminal mode end to end: real Qdrant local mode, real MiniLM, the real
SmolLM2 engine through the LangChain adapter, two turns of one conversation."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from examples.chatbot import chat, ingest

pytestmark = pytest.mark.slow

DOCS = {
    "nile.txt": "The Nile is a river in Africa. It flows north through Egypt into the Mediterranean Sea.",
    "fuji.txt": "Mount Fuji is the highest mountain in Japan, 3,776 metres high, near Tokyo.",
    "reef.txt": "The Great Barrier Reef is the largest coral reef system, off Queensland, Australia.",
}


@pytest.fixture(scope="module")
def qdrant_dir(tmp_path_factory):
    docs, qdrant = tmp_path_factory.mktemp("docs"), tmp_path_factory.mktemp("qdrant")
    for name, text in DOCS.items():
        (docs / name).write_text(text, encoding="utf-8")
    assert ingest.main(["--docs", str(docs), "--qdrant-path", str(qdrant)]) == 0
    return qdrant


def test_two_turns_stream_answers_sources_and_reuse(qdrant_dir, smol_dir):
    args = chat.build_parser().parse_args(["--qdrant-path", str(qdrant_dir), "--model", str(smol_dir), "--k", "2",
                                           "--max-tokens", "12"])
    out = io.StringIO()
    chat.run(args, iter(["Where does the Nile flow?", "Which sea does the Nile reach?"]), out)
    text = out.getvalue()
    assert "[A1]" in text and "[A2]" in text
    assert "source nile.txt:0" in text
    turns = [line for line in text.splitlines() if line.strip().startswith("TTFT")]
    assert len(turns) == 2
    reused = [int(line.split("tokens reused ")[1].split(",")[0]) for line in turns]
    assert reused[1] > 0  # the second turn continues from the first turn's KV


def test_empty_collection_is_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "examples.chatbot.chat", "--qdrant-path", str(tmp_path)],
                            input="hello\n", capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("chat: error: the Qdrant collection is empty")
