"""Prompt assembly by segments: template prefix, the passages, question + template suffix.

Each passage is tokenized on its own and the ids are concatenated, so a chunk yields the same
token ids wherever it sits. The chat template is rendered once with sentinel strings in the user
turn and split there, which works for any template (ChatML, Llama 3, Mistral) without knowing it.

A passage's cached identity is its *core*: the tokens from its first whitespace to its last
(`core_bounds`). Its first and last words join whatever the text around them is (" The" after a
space, ".\n\n" in Qwen's and Llama 3's tokenizers), so they are computed with the request as
separators; the core tokenizes the same wherever the passage is quoted. That is what lets KV
warmed or computed in the engine's layout serve a chat that quotes the passage (the verbatim
layout), and the other way round.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.request.fingerprint import token_ids_digest
from ragcache_integrations.types import Chunk, ChunkedPrompt

SegmentKind = Literal["prefix", "chunk", "question", "history", "separator"]
_CHUNKS_MARK = "\u2063RAGCACHE_CHUNKS\u2063"
_QUESTION_MARK = "\u2063RAGCACHE_QUESTION\u2063"
_ANSWER_MARK = "\u2063RAGCACHE_ANSWER\u2063"
QUESTION_TEMPLATE = "Answer the question using the passages above.\nQuestion: {question}"


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]
    chunk_id: str | None = None
    # a chunk's first word as the engine's layout tokenizes it: what a precompute of the chunk
    # computes before its core, in every layout, so KV computed alone is the same KV
    lead: tuple[int, ...] = ()


def segment_digest(segment: Segment) -> str:
    """A segment's content identity: the digest of its token ids."""
    return token_ids_digest(segment.token_ids)


@dataclass(frozen=True)
class Passage:
    """One passage in the engine's layout: its first word, its core (cached), the rest with the
    blank line after it."""

    head: Segment
    core: Segment
    tail: Segment

    @property
    def segments(self) -> list[Segment]:
        return [s for s in (self.head, self.core, self.tail) if s.token_ids]


@dataclass(frozen=True)
class AssembledPrompt:
    segments: list[Segment]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def __len__(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)


def core_bounds(passage: str) -> tuple[int, int]:
    """Character offsets [start, end) of a stripped passage's core. Whitespace splits words in
    every tokenizer we load (regex pre-tokenizers and SentencePiece alike), so a token never
    spans the first or the last whitespace with different ids in different contexts. Text without
    whitespace (Chinese, Japanese) falls back to where a run of letters or digits ends. (0, 0): no
    core (a single word), the passage is computed with the request."""
    spaces = [i for i in (_first_space(passage), _last_space(passage)) if i is not None]
    if len(spaces) == 2 and spaces[0] < spaces[1]:
        return spaces[0], spaces[1]
    ends = [i for i in range(1, len(passage)) if passage[i - 1].isalnum() and not passage[i].isalnum()]
    if len(ends) >= 2:
        return ends[0], ends[-1]
    return 0, 0


def _first_space(text: str) -> int | None:
    match = re.search(r"\s", text)
    return match.start() if match else None


def _last_space(text: str) -> int | None:
    for i in range(len(text) - 1, -1, -1):
        if text[i].isspace():
            return i
    return None


def check_text(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPromptError(f"{field} is not valid UTF-8 text (position {exc.start}); decode it first") from exc


class PromptBuilder:
    def __init__(self, tokenizer, cache_size: int = 4096):
        self.tokenizer = tokenizer
        self._token_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._passages: OrderedDict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = OrderedDict()
        self._cache_size = cache_size
        # the chat template rendered around a system prompt: a jinja render per request otherwise
        self._frames: OrderedDict[str, tuple[str, str]] = OrderedDict()

    @classmethod
    def load(cls, model_dir: Path) -> PromptBuilder:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def encode(self, text: str) -> tuple[int, ...]:
        cached = self._token_cache.get(text)
        if cached is not None:
            self._token_cache.move_to_end(text)
            return cached
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self._token_cache[text] = ids
        if len(self._token_cache) > self._cache_size:
            self._token_cache.popitem(last=False)
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _frame(self, system: str) -> tuple[str, str]:
        """Template text before the user content and after it (with the generation prompt)."""
        frame = self._frames.get(system)
        if frame is None:
            frame = self._frames[system] = self._render_frame(system)
            if len(self._frames) > 64:
                self._frames.popitem(last=False)
        else:
            self._frames.move_to_end(system)
        return frame

    def _render_frame(self, system: str) -> tuple[str, str]:
        if not self.chat_template:
            return f"{system}\n\n", "\nAnswer:"
        content = _CHUNKS_MARK + _QUESTION_MARK
        try:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": content}],
                tokenize=False, add_generation_prompt=True,
            )
        except Exception:  # templates without a system role (some Mistral ones) raise here
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{system}\n\n{content}"}],
                tokenize=False, add_generation_prompt=True,
            )
        head, rest = rendered.split(_CHUNKS_MARK, 1)
        tail = rest.split(_QUESTION_MARK, 1)[1]
        return head, tail

    def turn_separator(self, system: str) -> str:
        """Template text between an assistant answer and the next user turn's content
        (ChatML: '<|im_end|>\\n<|im_start|>user\\n')."""
        if not self.chat_template:
            return "\n\n"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "x"},
                    {"role": "assistant", "content": _ANSWER_MARK}, {"role": "user", "content": _CHUNKS_MARK}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return rendered.split(_ANSWER_MARK, 1)[1].split(_CHUNKS_MARK, 1)[0]

    def build_followup(self, prompt: ChunkedPrompt, known_digests: set[str]) -> AssembledPrompt:
        """The segments a conversation's next turn adds after its history: turn separator, the
        passages the conversation does not hold yet (by content: the digest of their core's token
        ids, never the caller's id, which a new passage may reuse), the question."""
        full = self.build(prompt)
        separator = Segment("separator", self.encode(self.turn_separator(prompt.system)))
        new = [seg for group in self._passage_groups(prompt.chunks)
               if segment_digest(group.core) not in known_digests for seg in group.segments]
        return AssembledPrompt([separator, *new, full.segments[-1]])

    def chunk_segment(self, chunk: Chunk) -> Segment:
        """The passage's core: what its KV is cached under (empty for a one-word passage)."""
        return self.passage(chunk).core

    def passage(self, chunk: Chunk) -> Passage:
        """The passage as the engine's layout sends it (`text.strip() + "\n\n"`), cut at its core."""
        text = chunk.text.strip()
        cached = self._passages.get(text)
        if cached is None:
            encoded = self.tokenizer(text + "\n\n", add_special_tokens=False, return_offsets_mapping=True)
            ids = [int(t) for t in encoded["input_ids"]]
            firsts = [first for first, _ in encoded["offset_mapping"]]
            start, end = core_bounds(text)
            head = tuple(t for t, f in zip(ids, firsts, strict=True) if f < start)
            core = tuple(t for t, f in zip(ids, firsts, strict=True) if start <= f < end)
            tail = tuple(ids[len(head) + len(core):])
            cached = self._passages[text] = (head, core, tail)
            if len(self._passages) > self._cache_size:
                self._passages.popitem(last=False)
        else:
            self._passages.move_to_end(text)
        head, core, tail = cached
        return Passage(Segment("separator", head), Segment("chunk", core, chunk.id, head), Segment("separator", tail))

    def _passage_groups(self, chunks: list[Chunk]) -> list[Passage]:
        return [self.passage(chunk) for chunk in chunks if chunk.text.strip()]

    def prefix_segment(self, system: str) -> Segment:
        return Segment("prefix", self.encode(self._frame(system)[0]))

    def build(self, prompt: ChunkedPrompt) -> AssembledPrompt:
        if prompt.messages is not None:
            return self.build_verbatim(prompt.messages, prompt.chunks)
        check_text("system", prompt.system)
        check_text("question", prompt.question)
        if not prompt.question.strip():
            raise InvalidPromptError("question is empty: give the question to answer")
        head, tail = self._frame(prompt.system)
        segments = [Segment("prefix", self.encode(head))]
        for i, chunk in enumerate(prompt.chunks):
            check_text(f"chunks[{i}].text", chunk.text)
        for group in self._passage_groups(prompt.chunks):  # blank after normalizing: nothing to send
            segments.extend(group.segments)
        question = QUESTION_TEMPLATE.format(question=prompt.question.strip()) if prompt.chunks else prompt.question
        segments.append(Segment("question", self.encode(question + tail)))
        return AssembledPrompt(segments)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a chat, with the generation prompt: what a plain chat computes."""
        if not messages:
            raise InvalidPromptError("messages is empty: give at least one message")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
                raise InvalidPromptError(f"messages[{i}] must be an object with a string 'content'")
            check_text(f"messages[{i}].content", m.get("content", ""))
        if self.chat_template:
            try:
                return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # jinja's UndefinedError, a template's raise_exception(), ...
                raise InvalidPromptError(self._template_failure(messages, exc)) from None
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise InvalidPromptError(f"messages[{i}] has no 'role': give each message a role (system, user or "
                                         "assistant) and a string 'content'")
        return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in messages) + "\nassistant:"

    def _template_failure(self, messages: list[dict[str, str]], exc: Exception) -> str:
        """One line naming the first message the chat template cannot render: the shortest prefix
        of the chat that fails ends with it (a binary search, so a long chat costs a few renders)."""
        lo, hi = 1, len(messages)  # messages[:hi] fails (with the generation prompt)
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                self.tokenizer.apply_chat_template(messages[:mid], tokenize=False, add_generation_prompt=True)
                lo = mid + 1
            except Exception:
                hi = mid
        index = hi - 1
        missing = [key for key in ("role", "content") if key not in messages[index]]
        if missing:
            return (f"messages[{index}] has no '{missing[0]}': give each message a role (system, user or assistant) "
                    "and a string 'content'")
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        return f"messages[{index}] cannot be rendered by the model's chat template: {reason}"

    def build_chat(self, messages: list[dict[str, str]]) -> AssembledPrompt:
        """A plain chat (no chunks): one template-rendered segment, computed fresh."""
        return AssembledPrompt([Segment("question", self.encode(self.render_chat(messages)))])

    def build_verbatim(self, messages: list[dict[str, str]], chunks: list[Chunk]) -> AssembledPrompt:
        """A chat rendered exactly as `build_chat` renders it, cut into segments at the chunks.

        The whole text is tokenized once and each token goes to the segment its first character
        lies in, so the token ids are exactly those of the plain chat (cutting the text first and
        tokenizing the pieces could merge differently at a cut). A chunk is cached under the
        tokens of its core (`core_bounds`), which are the same wherever the passage is quoted and
        in the engine's own layout; its first and last words go with the text around them."""
        text = self.render_chat(messages)
        cores: list[tuple[int, int, Chunk]] = []
        cursor = 0
        for i, chunk in enumerate(chunks):
            check_text(f"chunks[{i}].text", chunk.text)
            needle = chunk.text.strip()
            if not needle:
                continue
            start = text.find(needle, cursor)
            if start == -1:
                where = "after the previous chunk " if cursor else ""
                raise InvalidPromptError(
                    f"chunks[{i}].text does not occur {where}in the rendered messages: in the verbatim "
                    "layout every chunk must be quoted in the messages, in the order given")
            lo, hi = core_bounds(needle)
            if hi > lo:
                cores.append((start + lo, start + hi, chunk))
            cursor = start + len(needle)
        if not cores:
            # no passage: the text before the last message's content (template, system prompt,
            # earlier turns) is the prefix, so it can still be reused exactly
            last = messages[-1].get("content", "").strip()
            cut = text.rfind(last) if last else -1
            spans_cut = [cut] if cut > 0 else []
            return self._cut(text, spans_cut, [("prefix", None), ("question", None)][-1 - len(spans_cut):])
        cuts = [c for s, e, _ in cores for c in (s, e)]
        owners: list[tuple[SegmentKind, str | None]] = [("prefix", None)] + [
            kind for _, _, chunk in cores for kind in (("chunk", chunk.id), ("separator", None))]
        owners[-1] = ("question", None)
        leads = iter([self.passage(chunk).head.token_ids for _, _, chunk in cores])
        return AssembledPrompt([Segment(s.kind, s.token_ids, s.chunk_id, next(leads)) if s.kind == "chunk" else s
                                for s in self._cut(text, cuts, owners).segments])

    def _cut(self, text: str, cuts: list[int], owners: list[tuple[SegmentKind, str | None]]) -> AssembledPrompt:
        """Tokenize `text` once and give each token to the part its first character lies in;
        parts are [0, cuts[0]), [cuts[0], cuts[1]), ... owned by `owners` in order."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int64)
        firsts = np.asarray([first for first, _ in encoded["offset_mapping"]], dtype=np.int64)
        # part of each token: how many cuts lie at or before its first character
        bounds = np.searchsorted(np.searchsorted(cuts, firsts, side="right"), np.arange(len(owners) + 1))
        segments = [Segment(kind, tuple(ids[lo:hi].tolist()), chunk_id)
                    for (kind, chunk_id), lo, hi in zip(owners, bounds[:-1], bounds[1:], strict=True) if hi > lo]
        if segments[0].kind != "prefix":  # the planner expects one (a chunk opened the text)
            segments.insert(0, Segment("prefix", ()))
        return AssembledPrompt(segments)
