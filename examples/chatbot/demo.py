"""`make demo`: the sample chatbot end to end on embedded defaults. Starts a sidecar, ingests the
corpus into Qdrant if needed, and replays a short day of two users: several different questions in
separate chats, whose retrieved passages come back in new orders, plus a follow-up in a chat.
Prints each answer beside full prefill's, its sources, the chunk hits and the TTFT against full
prefill, then a table; stops everything it started.

Every turn is also answered with policy `full` (no reuse; the same question, retrieval and
conversation) on the same sidecar right before, so the speed-up and the answers are compared side
by side. Full prefill caches nothing, so the turn after it starts from what earlier turns cached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache_integrations.policy_registry import DEFAULT_POLICY, forms_text, policy_arg

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUNDLED_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "demo.json"


@dataclass(frozen=True)
class Turn:
    """One question of the script: who asks it, in which of their chats."""

    user: str
    chat: int
    question: str

    @property
    def conversation_id(self) -> str:
        return f"demo-{self.user}-{self.chat}"

    @property
    def label(self) -> str:
        return f"{self.user}, chat {self.chat}"


@dataclass
class Answered:
    """One turn's outcome under the chosen policy and under full prefill."""

    turn: Turn
    stats: dict[str, Any]
    full: dict[str, Any]
    answer: str
    full_answer: str

    @property
    def agreement(self) -> str:
        return answer_agreement(self.answer, self.full_answer)


def shared_words(answer: str, full_answer: str) -> tuple[int, int] | None:
    """None when the two answers are the same words; else (leading words they share, words in the
    longer one)."""
    ours, theirs = answer.split(), full_answer.split()
    if ours == theirs:
        return None
    shared = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return shared, max(len(ours), len(theirs))


def answer_agreement(answer: str, full_answer: str) -> str:
    """'same', or how many leading words the answer shares with full prefill's."""
    shared = shared_words(answer, full_answer)
    return "same" if shared is None else f"first {shared[0]} of {shared[1]} words"


async def run_turn(service: Any, conversation_id: str, question: str, out: Any = None) -> tuple[str, list, dict]:
    """One turn through the chat service: (answer, sources, stats); the answer streams to `out`."""
    text: list[str] = []
    sources: list = []
    stats: dict[str, Any] = {}
    async for event in service.turn(conversation_id, question):
        if event["type"] == "delta":
            text.append(event["text"])
            if out is not None:
                print(event["text"], end="", file=out, flush=True)
        elif event["type"] == "sources":
            sources = event["sources"]
        elif event["type"] == "stats":
            stats = event
    return "".join(text).strip(), sources, stats


def hits_text(stats: dict[str, Any]) -> str:
    text = f"{stats['chunk_hits']}/{stats['chunks']}"
    if stats["chunks_deduplicated"]:
        text += f" (+{stats['chunks_deduplicated']} already in the chat)"
    return text


async def ask_all(reuse: Any, full: Any, turns: list[Turn], out: Any) -> list[Answered]:
    rows: list[Answered] = []
    for n, turn in enumerate(turns, 1):
        full_answer, _, baseline = await run_turn(full, turn.conversation_id + "-full", turn.question)
        print(f"\n[Q{n}] ({turn.label}) {turn.question}\n[A{n}] ", end="", file=out, flush=True)
        answer, sources, stats = await run_turn(reuse, turn.conversation_id, turn.question, out)
        row = Answered(turn, stats, baseline, answer, full_answer)
        print(f"\n  full prefill's answer: {full_answer}  [{row.agreement}]", file=out)
        for s in sources:
            print(f"  source {s['id']}: {s['text'][:80].replace(chr(10), ' ')}...", file=out)
        print(f"  TTFT {stats['ttft_s']:.2f}s (full prefill {baseline['ttft_s']:.2f}s) | chunk hits {hits_text(stats)}"
              f" | tokens reused {stats['tokens_reused']} (fused {stats['tokens_fused']}), recomputed "
              f"{stats['tokens_recomputed']}, computed {stats['tokens_computed']} | {story(rows, row)}",
              file=out, flush=True)
        rows.append(row)
    return rows


def story(earlier: list[Answered], row: Answered) -> str:
    """What this turn shows, in words: from the numbers, never from the script."""
    stats = row.stats
    others = {r.turn.conversation_id for r in earlier} - {row.turn.conversation_id}
    if stats["chunks_deduplicated"] and not stats["chunks"]:
        return "a follow-up: the chat's own KV continued (an exact prefix)"
    if stats["chunk_hits"] and stats["tokens_fused"] and others:
        return "passages cached by other chats, fused at new positions"
    if stats["chunk_hits"]:
        return "passages cached before, reused"
    return "new passages: computed and cached"


def fused_elsewhere(rows: list[Answered]) -> list[Answered]:
    """Turns that fused passages another chat had cached: the chunk fusion a prefix cache cannot do."""
    return [r for r in rows if r.stats["chunk_hits"] and r.stats["tokens_fused"]
            and any(e.turn.conversation_id != r.turn.conversation_id for e in rows[:rows.index(r)])]


def summary_table(rows: list[Answered], policy: str) -> Any:
    """The run in a table narrow enough for an 80-column terminal (the per-question lines above it
    hold the rest: reused and recomputed tokens, the answers themselves)."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"what reuse saved ({policy} vs full prefill, same sidecar, same run)", box=box.SIMPLE_HEAD,
                  caption="hits: retrieved passages found cached; fused: reused tokens of passages placed at new "
                          "positions; fresh: tokens computed without cache; full: full prefill's TTFT; answer: "
                          "the leading words it shares with full prefill's")
    for col in ("#", "who", "hits", "fused", "fresh", "TTFT", "full", "speed-up", "answer"):
        text = col in ("who", "answer")  # wrapped when the terminal is narrow; numbers never cut
        table.add_column(col, justify="left" if text else "right", no_wrap=not text, overflow="fold")
    for n, row in enumerate(rows, 1):
        stats, full = row.stats, row.full
        table.add_row(str(n), f"{row.turn.user} {row.turn.chat}", f"{stats['chunk_hits']}/{stats['chunks']}",
                      str(stats["tokens_fused"]), str(stats["tokens_computed"]), f"{stats['ttft_s']:.2f}s",
                      f"{full['ttft_s']:.2f}s", f"{full['ttft_s'] / max(stats['ttft_s'], 1e-9):.1f}x",
                      short_agreement(row.answer, row.full_answer))
    return table


def short_agreement(answer: str, full_answer: str) -> str:
    """`answer_agreement` in a table cell: 'same', or 'k/n words'."""
    shared = shared_words(answer, full_answer)
    return "same" if shared is None else f"{shared[0]}/{shared[1]} words"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.chatbot.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=Path, default=BUNDLED_QUESTIONS,
                   help="JSON file with 'turns' ({user, chat, question} objects, asked in order) or a 'questions' "
                        "list (one user, one chat) (default: the bundled two-user script)")
    p.add_argument("--qdrant-path", type=Path, default=None, help="Qdrant local-mode folder "
                   "(default: $RAGCACHE_HOME/qdrant; ingested on first use)")
    p.add_argument("--qdrant-url", default=None, help="a Qdrant server instead of local mode")
    p.add_argument("--model", default="default", help="sidecar model (default: SmolLM2 from its wheel)")
    p.add_argument("--k", type=int, default=3, help="passages retrieved per question (default 3)")
    p.add_argument("--policy", default=DEFAULT_POLICY, type=policy_arg, help=f"ragcache policy: {forms_text()} (default {DEFAULT_POLICY})")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length limit (default 32)")
    return p


def load_turns(path: Path) -> list[Turn]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"demo: error: cannot read {path}: {exc}") from None
    data = data if isinstance(data, dict) else {}
    if "turns" in data:
        turns = data["turns"]
        if not (isinstance(turns, list) and turns and all(_is_turn(t) for t in turns)):
            raise SystemExit(f"demo: error: {path}: 'turns' needs a non-empty list of objects with 'user' (letters, "
                             "digits, '_' or '-'), 'chat' (a whole number) and 'question' (text)")
        return [Turn(t["user"], int(t["chat"]), t["question"]) for t in turns]
    questions = data.get("questions")
    if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
        raise SystemExit(f"demo: error: {path} needs 'turns' or a non-empty 'questions' list of strings")
    return [Turn("you", 1, q) for q in questions]


def _is_turn(turn: object) -> bool:
    return (isinstance(turn, dict) and isinstance(turn.get("user"), str)
            and turn["user"].replace("_", "").replace("-", "").isalnum() and len(turn["user"]) <= 24
            and isinstance(turn.get("chat"), int) and not isinstance(turn["chat"], bool) and 0 <= turn["chat"] < 10**6
            and isinstance(turn.get("question"), str) and bool(turn["question"].strip()))


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from engine_sidecar.server.process import SidecarError, SidecarProcess
    from examples.chatbot.ingest import embedder, ensure_ingested, open_qdrant
    from examples.chatbot.service import ChatService, ChatSettings

    args = build_parser().parse_args(argv)
    if args.k < 1 or args.max_tokens < 1:
        raise SystemExit("demo: error: --k and --max-tokens must be at least 1")
    turns = load_turns(args.questions)
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="ragcache-demo-"))
    client = open_qdrant(args.qdrant_path, args.qdrant_url)
    sidecar = None
    finished = False
    try:
        model = embedder()
        points = ensure_ingested(client, model)
        users = sorted({t.user for t in turns})
        chats = len({t.conversation_id for t in turns})
        console.print(f"[bold]ragcache demo[/bold]: {len(turns)} questions from {len(users)} user(s) "
                      f"({', '.join(users)}) in {chats} chat(s), top-{args.k} of {points} passages in Qdrant")
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
        rows = asyncio.run(ask_all(reuse, full, turns, sys.stdout))
        console.print()
        console.print(summary_table(rows, args.policy))
        fused = fused_elsewhere(rows)
        same = sum(r.agreement == "same" for r in rows)
        console.print(f"Chunk fusion: {len(fused)} of {len(rows)} questions reused passages that another chat had "
                      f"cached, at new positions ({', '.join(f'Q{rows.index(r) + 1}' for r in fused) or 'none'}); "
                      "a prefix cache reuses only an exact prefix. "
                      f"Answers: {same} of {len(rows)} the same words as full prefill's.")
        finished = True
    except ValueError as exc:
        raise SystemExit(f"demo: error: {exc}") from None
    finally:
        client.close()
        if sidecar is not None:
            sidecar.stop()
            console.print("sidecar stopped")
        # the fresh chunk cache is hundreds of MB per run: kept only when a failed run needs its log
        if finished or sidecar is None:
            shutil.rmtree(work, ignore_errors=True)
        elif sidecar is not None:
            console.print(f"the sidecar's log is kept in {sidecar.log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
