"""Chunk recovery: find the retrieved passages inside a prompt that a framework already flattened.

LlamaIndex's response synthesizers and LangChain's stuff-documents chains join the retrieved
texts into one string and format it into their own template, so a drop-in LLM only sees text.
The adapters observe which passages the app retrieved (LlamaIndex instrumentation, LangChain
callbacks or the documents they are given) and remember them in a `ChunkRegistry`; `recover`
then locates those exact texts in the prompt. Matching is exact substring search, so a
recovered chunk is always text the prompt really holds.

The prompt is sent in the engine's verbatim layout: the app's messages exactly as they are,
plus the recovered passages as chunks. The engine renders the messages with the model's chat
template like a plain chat and caches the tokens that fall inside each passage, so the tokens
the model sees are exactly those a plain LLM would have sent; only how they are computed
changes. A prompt with no recognised passage is sent as a plain chat.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragcache_integrations.types import Chunk, ChunkedPrompt

DEFAULT_MIN_CHUNK_CHARS = 16
# a retrieved passage quoted more often than this in one message is not context any more
MAX_HITS_PER_PASSAGE = 8

_ROLE = {"system": "system", "developer": "system", "user": "user", "human": "user",
         "assistant": "assistant", "ai": "assistant", "model": "assistant", "chatbot": "assistant"}


@dataclass(frozen=True)
class Candidate:
    """A passage the app retrieved: its text as formatted into prompts, and its stable id."""

    text: str
    id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


class ChunkRegistry:
    """Recently retrieved passages, newest first, bounded by count.

    Process-wide on purpose: a retriever may run on another thread or task than the LLM call
    (LangChain runs parallel branches in a pool). Sharing is safe because a passage only becomes
    a chunk where its exact text is already in the prompt, and KV is keyed by tenant anyway."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._entries: OrderedDict[str, Candidate] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, text: str, id: str | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        key = text.strip()
        if not key:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            if id is None and previous is not None:  # an anonymous sighting keeps the known id
                id, metadata = previous.id, metadata or previous.metadata
            self._entries[key] = Candidate(key, id, dict(metadata or {}))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def add_all(self, candidates: Iterable[Candidate]) -> None:
        for c in candidates:
            self.add(c.text, c.id, c.metadata)

    def snapshot(self) -> list[Candidate]:
        with self._lock:
            return list(reversed(self._entries.values()))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


REGISTRY = ChunkRegistry()


@dataclass(frozen=True)
class RecoveredText:
    """One message split as `before | context block | after`. `pieces` is the context block in
    order (chunks, and between them the original separator strings), so `render()` gives back
    the original text exactly."""

    before: str
    pieces: tuple[str | Chunk, ...]
    after: str

    @property
    def chunks(self) -> list[Chunk]:
        # text between two recognised passages that is more than a separator (a citation
        # header, a fragment the framework cut) is context too: it is sent as its own chunk
        # (a content-hash id) rather than moved into the question
        return [p if isinstance(p, Chunk) else Chunk(text=p) for p in self.pieces
                if isinstance(p, Chunk) or p.strip()]

    def render(self) -> str:
        return self.before + "".join(p.text if isinstance(p, Chunk) else p for p in self.pieces) + self.after


def _chunk_for(candidate: Candidate, text: str, id_key: str | None) -> Chunk:
    chunk_id = candidate.id or (candidate.metadata.get(id_key) if id_key else None)
    return Chunk(text=text, id=str(chunk_id) if chunk_id else None)


def recover(text: str, candidates: Sequence[Candidate], *, min_chars: int = DEFAULT_MIN_CHUNK_CHARS,
            id_key: str | None = None, max_hits: int = MAX_HITS_PER_PASSAGE) -> RecoveredText | None:
    """Locate candidate passages in `text`; None when none is found.

    Longer passages win over shorter ones they overlap (a short passage may be a substring of a
    longer one); among equals, the earlier in `candidates` (the newest retrieval) wins. Each
    passage is searched once over the text (C-speed substring search, linear in the text) and
    counted at most `max_hits` times; the overlap test keeps the chosen spans sorted, so the
    whole match is O(passages x text + hits log hits), never quadratic in the text."""
    found: list[tuple[int, int, int, Candidate]] = []
    for rank, cand in enumerate(candidates):
        needle = cand.text.strip()
        if len(needle) < min_chars:
            continue  # short strings match by accident (a word of the instructions)
        start, hits = text.find(needle), 0
        while start != -1 and hits < max_hits:
            found.append((start, start + len(needle), rank, cand))
            start, hits = text.find(needle, start + len(needle)), hits + 1
    if not found:
        return None
    found.sort(key=lambda f: (-(f[1] - f[0]), f[2], f[0]))
    starts: list[int] = []  # of the spans taken, sorted; no two overlap, so their ends are sorted too
    taken: dict[int, tuple[int, Candidate]] = {}
    for start, end, _, cand in found:
        at = bisect.bisect_right(starts, start)
        if at and taken[starts[at - 1]][0] > start:
            continue  # overlaps the span that starts before it
        if at < len(starts) and starts[at] < end:
            continue  # overlaps the span that starts after it
        starts.insert(at, start)
        taken[start] = (end, cand)
    pieces: list[str | Chunk] = []
    cursor = starts[0]
    for start in starts:
        end, cand = taken[start]
        if start > cursor:
            pieces.append(text[cursor:start])
        pieces.append(_chunk_for(cand, text[start:end], id_key))
        cursor = end
    return RecoveredText(text[: starts[0]], tuple(pieces), text[cursor:])


@dataclass(frozen=True)
class Recovery:
    """The outcome for one prompt: a ChunkedPrompt, or None with the reason it stays plain."""

    prompt: ChunkedPrompt | None
    reason: str = ""
    recovered: RecoveredText | None = None


def normalize_messages(messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]] | None:
    """Framework roles mapped to system/user/assistant; None if a role has no such meaning."""
    out = []
    for m in messages:
        role = _ROLE.get(str(m.get("role", "")).lower())
        if role is None:
            return None
        out.append({"role": role, "content": str(m.get("content") or "")})
    return out


def to_chunked_prompt(messages: Sequence[Mapping[str, str]], candidates: Sequence[Candidate], *,
                      min_chars: int = DEFAULT_MIN_CHUNK_CHARS, id_key: str | None = None,
                      conversation_id: str | None = None) -> Recovery:
    """The messages as a verbatim-layout ChunkedPrompt with the passages found in them, or why
    they stay a plain chat. Any message shape works (system prompts, earlier turns): passages
    are looked for in every message, in order."""
    normalized = normalize_messages(messages)
    if normalized is None:
        return Recovery(None, "a message role other than system/user/assistant")
    if not normalized:
        return Recovery(None, "no messages")
    if not candidates:
        return Recovery(None, "no retrieved passages known")
    chunks: list[Chunk] = []
    holder: RecoveredText | None = None
    for message in normalized:
        found = recover(message["content"], candidates, min_chars=min_chars, id_key=id_key)
        if found is not None:
            chunks.extend(p for p in found.pieces if isinstance(p, Chunk))
            holder = holder or found
    if not chunks:
        return Recovery(None, "none of the retrieved passages occurs in the prompt")
    return Recovery(ChunkedPrompt(messages=normalized, chunks=chunks, conversation_id=conversation_id),
                    recovered=holder)


def with_chunks(messages: Sequence[Mapping[str, str]], chunks: Sequence[Chunk]) -> Recovery:
    """The structured path: messages already formatted with the passages in place, and the
    passages known as chunks (with their ids). Gives the ChunkedPrompt `to_chunked_prompt`
    recovers from the same messages when it knows the same passages."""
    normalized = normalize_messages(messages)
    if normalized is None:
        return Recovery(None, "a message role other than system/user/assistant")
    kept = [c for c in chunks if c.text.strip()]
    rendered = "\n".join(m["content"] for m in normalized)
    cursor = 0
    for c in kept:  # the engine insists on this; say it here as a fallback reason instead
        at = rendered.find(c.text.strip(), cursor)
        if at == -1:
            return Recovery(None, "a passage is not quoted verbatim in the formatted prompt")
        cursor = at + len(c.text.strip())
    if not kept:
        return Recovery(None, "no passages")
    return Recovery(ChunkedPrompt(messages=normalized, chunks=kept))
