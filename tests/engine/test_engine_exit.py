"""An engine a script never closes: at interpreter exit it is closed for the script, so the
process exits 0 (not SIGABRT from a daemon thread torn down inside torch) with every disk write
it had queued complete; and a closed engine leaves none of its threads running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from engine_sidecar.store.disk import DiskTier
from ragcache_integrations import ChunkedPrompt
from tests.policy_prompt import PASSAGES, QUESTION

ROOT = Path(__file__).resolve().parents[2]
MUSIQUE = ROOT.parent / "shared" / "data" / "musique_s.json"

# eight passages of about 100 words: their files (about 6 MB each for SmolLM2) take the disk writer
# longer than one token takes, so without a close at exit some are still being written when the
# script ends
OWN_PASSAGES = [
    " ".join(f"{topic} record {i}: the survey counted {i * 7} sites along the {topic} valley, most of them "
             f"settled before the river changed course in the year {1200 + i * 13}." for i in range(6))
    for topic in ("Rhine", "Loire", "Ebro", "Po", "Elbe", "Oder", "Tagus", "Douro")
]

SCRIPT = """
import json, sys
from engine_sidecar import Engine
from ragcache_integrations import ChunkedPrompt
model, passages = sys.argv[1], json.loads(sys.argv[2])
e = Engine.from_pretrained(model)
print(e.generate(ChunkedPrompt(chunks=passages, question="Which valley has the most sites?"),
                 {"max_tokens": 1}).text)
print(json.dumps(sorted(d for held in e.cache.store.chunk_id_index().values() for d in held)), flush=True)
"""


def _passages() -> list[str]:
    """Real passages where the benchmark data is at hand (their first 100 words), else our own."""
    if MUSIQUE.is_file():
        record = json.loads(MUSIQUE.read_text(encoding="utf-8"))[0]
        return [" ".join(c["text"].split()[:100]) for c in record["ctxs"][:8]]
    return OWN_PASSAGES


def test_a_script_that_never_closes_the_engine_exits_0_with_its_disk_writes_done(smol_dir, tmp_path):
    home = tmp_path / "home"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(smol_dir), json.dumps(_passages())], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAGCACHE_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-2000:]
    digests = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(digests) == 8  # one entry per passage
    kv = home / "kv"
    assert not list(kv.rglob("*.tmp"))  # no write was cut short
    tier = DiskTier(kv)
    for digest in digests:  # every passage's file is there, whole: it reads back verified
        assert tier.path_for(digest).is_file() and tier.get(digest) is not None, digest


def test_a_closed_engine_leaves_none_of_its_threads_running(tiny_llama_dir, tmp_path):
    from engine_sidecar import Engine

    before = set(threading.enumerate())
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", cache_dir=tmp_path / "kv",
                                precompute="background") as engine:
        engine.generate(ChunkedPrompt(chunks=PASSAGES, question=QUESTION), {"max_tokens": 2})
        engine.wait_background()
        started = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        assert {"ragcache-scheduler", "ragcache-disk-writer"} <= set(started), started
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == []
    assert engine.cache.store.disk is not None and len(engine.cache.store.disk) >= len(PASSAGES)  # written before the end
