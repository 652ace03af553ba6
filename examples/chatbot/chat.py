"""The sample chatbot in a terminal: retrieve from Qdrant (MiniLM), answer through ragcache's
LangChain adapter with a conversation id, show sources and what reuse saved on every turn.

    python -m examples.chatbot.ingest                      # once (idempotent)
    python -m examples.chatbot.chat                        # in-process engine, type questions
    python -m examples.chatbot.chat --base-url http://127.0.0.1:8808 < questions.txt

Questions come from the terminal, or one per line from stdin when it is not a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ragcache_integrations.policy_registry import DEFAULT_POLICY, forms_text, policy_arg

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEM = "You are a helpful assistant. Answer briefly, using only the passages."


def make_retriever(client: Any, model: Any, k: int) -> Any:
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from examples.chatbot.ingest import COLLECTION

    class QdrantRetriever(BaseRetriever):
        """Top-k passages by cosine similarity; Document.id is the stable chunk id."""

        client: Any
        model: Any
        k: int

        def _get_relevant_documents(self, query: str, *,
                                    run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
            vector = self.model.encode([query], normalize_embeddings=True, convert_to_numpy=True)[0]
            hits = self.client.query_points(COLLECTION, query=vector.tolist(), limit=self.k).points
            return [Document(id=h.payload["chunk_id"], page_content=h.payload["text"],
                             metadata={"doc_id": h.payload["doc_id"], "score": h.score}) for h in hits]

    return QdrantRetriever(client=client, model=model, k=k)


def questions_from(stream: Any) -> Iterator[str]:
    interactive = stream.isatty()
    while True:
        if interactive:
            print("\nyou> ", end="", flush=True)
        line = stream.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def format_stats(stats: dict[str, Any]) -> str:
    return (f"TTFT {stats['ttft_s']:.2f}s | tokens reused {stats['tokens_reused']}, recomputed "
            f"{stats['tokens_recomputed']}, computed {stats['tokens_computed_fresh']} | chunk hits "
            f"{stats['chunk_hits']}/{stats['chunk_hits'] + stats['chunk_misses']}")


def run(args: argparse.Namespace, questions: Iterator[str], out: Any = sys.stdout) -> int:
    from examples.chatbot.ingest import COLLECTION, embedder, open_qdrant
    from ragcache_integrations.langchain import ChunkCachedRunnable

    client = open_qdrant(args.qdrant_path, args.qdrant_url)
    engine = None
    try:
        if not client.collection_exists(COLLECTION) or client.count(COLLECTION).count == 0:
            raise SystemExit("chat: error: the Qdrant collection is empty; run `python -m examples.chatbot.ingest` "
                             "first (with the same --qdrant-path / --qdrant-url)")
        retriever = make_retriever(client, embedder(), args.k)
        if args.base_url:
            backend: dict[str, Any] = {"base_url": args.base_url}
        else:
            from engine_sidecar import Engine

            engine = Engine.from_pretrained(args.model, device="cpu")
            backend = {"engine": engine}
        answer = ChunkCachedRunnable(**backend, system=SYSTEM, policy=args.policy, max_tokens=args.max_tokens,
                                     conversation_id=args.conversation_id or f"chat-{uuid.uuid4().hex[:8]}")
        for turn, question in enumerate(questions, 1):
            docs = retriever.invoke(question)
            print(f"\n[Q{turn}] {question}\n[A{turn}] ", end="", file=out, flush=True)
            for delta in answer.stream({"input": question, "context": docs}):
                print(delta, end="", file=out, flush=True)
            print(file=out)
            for doc in docs:
                print(f"  source {doc.id}: {doc.page_content[:90].replace(chr(10), ' ')}...", file=out)
            print(f"  {format_stats(answer.last_stats)}", file=out, flush=True)
    finally:
        client.close()
        if engine is not None:
            engine.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.chatbot.chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a `ragcache serve` sidecar (default: an in-process engine)")
    p.add_argument("--model", default="default", help="in-process engine model (default: SmolLM2 from its wheel)")
    p.add_argument("--qdrant-path", type=Path, default=None, help="Qdrant local-mode folder "
                   "(default: $RAGCACHE_HOME/qdrant)")
    p.add_argument("--qdrant-url", default=None, help="a Qdrant server instead of local mode")
    p.add_argument("--k", type=int, default=3, help="passages retrieved per question (default 3)")
    p.add_argument("--policy", default=DEFAULT_POLICY, type=policy_arg, help=f"ragcache policy: {forms_text()} (default {DEFAULT_POLICY})")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--conversation-id", default=None, help="continue a conversation (default: a new one)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.k < 1 or args.max_tokens < 1:
        raise SystemExit("chat: error: --k and --max-tokens must be at least 1")
    return run(args, questions_from(sys.stdin))


if __name__ == "__main__":
    sys.exit(main())
