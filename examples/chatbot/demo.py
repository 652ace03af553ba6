"""`make demo`: the sample chatbot end to end on embedded defaults. Starts a sidecar, ingests the
corpus into Qdrant if needed, asks a scripted series of related questions in one conversation,
prints answers, sources and what reuse saved, and stops everything it started.

Every turn is also answered with policy `full` (no reuse; the same questions, retrieval and
conversation) on the same sidecar right before, so the speed-up is measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ragcache_integrations.policy_registry import DEFAULT_POLICY, forms_text, policy_arg

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUNDLED_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "demo.json"


async def ask_all(reuse: Any, full: Any, questions: list[str], out: Any) -> list[tuple[dict, dict]]:
    rows = []
    for n, question in enumerate(questions, 1):
        baseline: dict[str, Any] = {}
        async for event in full.turn("demo-full", question):
            if event["type"] == "stats":
                baseline = event
        print(f"\n[Q{n}] {question}\n[A{n}] ", end="", file=out, flush=True)
        stats: dict[str, Any] = {}
        async for event in reuse.turn("demo", question):
            if event["type"] == "delta":
                print(event["text"], end="", file=out, flush=True)
            elif event["type"] == "sources":
                sources = event["sources"]
            elif event["type"] == "stats":
                stats = event
        print(file=out)
        for s in sources:
            print(f"  source {s['id']}: {s['text'][:90].replace(chr(10), ' ')}...", file=out)
        print(f"  TTFT {stats['ttft_s']:.2f}s (full prefill {baseline['ttft_s']:.2f}s) | tokens reused "
              f"{stats['tokens_reused']}, recomputed {stats['tokens_recomputed']}, computed {stats['tokens_computed']}"
              f" | chunk hits {stats['chunk_hits']}/{stats['chunks']}"
              + (f" (+{stats['chunks_deduplicated']} already in the conversation)" if stats["chunks_deduplicated"]
                 else ""), file=out, flush=True)
        rows.append((stats, baseline))
    return rows


def summary_table(rows: list[tuple[dict, dict]], policy: str) -> Any:
    from rich.table import Table

    table = Table(title=f"what reuse saved ({policy} vs full prefill, same sidecar, same run)",
                  caption="tokens: prompt tokens; recomp: reused but recomputed; fresh: computed without cache; "
                          "full: full prefill TTFT")
    for col in ("turn", "tokens", "reused", "recomp", "fresh", "hits", "TTFT", "full", "speed-up"):
        table.add_column(col, justify="right", no_wrap=True)
    for stats, full in rows:
        table.add_row(str(stats["turn"]), str(stats["prefill_tokens"]), str(stats["tokens_reused"]),
                      str(stats["tokens_recomputed"]), str(stats["tokens_computed"]),
                      f"{stats['chunk_hits']}/{stats['chunks']}", f"{stats['ttft_s']:.2f}s", f"{full['ttft_s']:.2f}s",
                      f"{full['ttft_s'] / max(stats['ttft_s'], 1e-9):.1f}x")
    return table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.chatbot.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=Path, default=BUNDLED_QUESTIONS,
                   help="JSON file with a 'questions' list asked in order (default: the bundled related questions)")
    p.add_argument("--qdrant-path", type=Path, default=None, help="Qdrant local-mode folder "
                   "(default: $RAGCACHE_HOME/qdrant; ingested on first use)")
    p.add_argument("--qdrant-url", default=None, help="a Qdrant server instead of local mode")
    p.add_argument("--model", default="default", help="sidecar model (default: SmolLM2 from its wheel)")
    p.add_argument("--k", type=int, default=3, help="passages retrieved per question (default 3)")
    p.add_argument("--policy", default=DEFAULT_POLICY, type=policy_arg, help=f"ragcache policy: {forms_text()} (default {DEFAULT_POLICY})")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length limit (default 32)")
    return p


def load_questions(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"demo: error: cannot read {path}: {exc}") from None
    questions = data.get("questions") if isinstance(data, dict) else None
    if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
        raise SystemExit(f"demo: error: {path} needs a non-empty 'questions' list of strings")
    return questions


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from engine_sidecar.server.process import SidecarError, SidecarProcess
    from examples.chatbot.ingest import embedder, ensure_ingested, open_qdrant
    from examples.chatbot.service import ChatService, ChatSettings

    args = build_parser().parse_args(argv)
    if args.k < 1 or args.max_tokens < 1:
        raise SystemExit("demo: error: --k and --max-tokens must be at least 1")
    questions = load_questions(args.questions)
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="ragcache-demo-"))
    client = open_qdrant(args.qdrant_path, args.qdrant_url)
    sidecar = None
    try:
        model = embedder()
        points = ensure_ingested(client, model)
        console.print(f"[bold]ragcache demo[/bold]: {len(questions)} related questions, one conversation, "
                      f"top-{args.k} of {points} passages in Qdrant")
        # a fresh chunk cache, so the first turn shows the misses a new deployment pays
        sidecar = SidecarProcess(work / "sidecar.log", "--model", args.model, "--cache-dir", str(work / "kv"))
        console.print(f"starting the sidecar (log: {sidecar.log_path}) ...")
        try:
            sidecar.start()
        except SidecarError as exc:
            raise SystemExit(f"demo: error: {exc}") from None
        console.print(sidecar.banner.replace("[", r"\["))
        backend = {"base_url": sidecar.base}
        reuse = ChatService(client, model, backend, ChatSettings(k=args.k, policy=args.policy,
                                                                 max_tokens=args.max_tokens))
        full = ChatService(client, model, backend, ChatSettings(k=args.k, policy="full", max_tokens=args.max_tokens))
        rows = asyncio.run(ask_all(reuse, full, questions, sys.stdout))
        console.print()
        console.print(summary_table(rows, args.policy))
        console.print("Turn 1 computes the retrieved passages' KV (misses) and stores it; later turns continue "
                      "from the conversation's KV and fuse cached passages.")
    except ValueError as exc:
        raise SystemExit(f"demo: error: {exc}") from None
    finally:
        client.close()
        if sidecar is not None:
            sidecar.stop()
            console.print("sidecar stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
