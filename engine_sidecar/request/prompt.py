"""Prompt assembly by segments: template prefix, one segment per chunk, question + template suffix.

Each segment is tokenized on its own and the ids are concatenated, so a chunk yields the same
token ids wherever it sits. The chat template is rendered once with sentinel strings in the user
turn and split there, which works for any template (ChatML, Llama 3, Mistral) without knowing it.
"""

from __future__ import annotations

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


def segment_digest(segment: Segment) -> str:
    """A segment's content identity: the digest of its token ids."""
    return token_ids_digest(segment.token_ids)


@dataclass(frozen=True)
class AssembledPrompt:
    segments: list[Segment]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def __len__(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)


def check_text(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPromptError(f"{field} is not valid UTF-8 text (position {exc.start}); decode it first") from exc


class PromptBuilder:
    def __init__(self, tokenizer, cache_size: int = 4096):
        self.tokenizer = tokenizer
        self._token_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
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
        chunks the conversation does not hold yet (by content: the digest of their token ids,
        never the caller's id, which a new passage may reuse), the question."""
        full = self.build(prompt)
        separator = Segment("separator", self.encode(self.turn_separator(prompt.system)))
        new = [s for s in full.segments if s.kind == "chunk" and segment_digest(s) not in known_digests]
        return AssembledPrompt([separator, *new, full.segments[-1]])

    def chunk_segment(self, chunk: Chunk) -> Segment:
        return Segment("chunk", self.encode(chunk.text.strip() + "\n\n"), chunk.id)

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
            if not chunk.text.isspace() and chunk.text:  # blank after normalizing: nothing to send
                segments.append(self.chunk_segment(chunk))
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
        tokens that fell in it; a passage usually starts and ends at a newline, where the
        tokenizer splits anyway, so it gets the same tokens wherever it is quoted."""
        text = self.render_chat(messages)
        spans: list[tuple[int, int, Chunk]] = []
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
            spans.append((start, start + len(needle), chunk))
            cursor = start + len(needle)
        if not spans:
            # no passage: the text before the last message's content (template, system prompt,
            # earlier turns) is the prefix, so it can still be reused exactly
            last = messages[-1].get("content", "").strip()
            cut = text.rfind(last) if last else -1
            spans_cut = [cut] if cut > 0 else []
            return self._cut(text, spans_cut, [("prefix", None), ("question", None)][-1 - len(spans_cut):])
        cuts = [0] + [c for s, e, _ in spans for c in (s, e)]
        owners: list[tuple[SegmentKind, str | None]] = [("prefix", None)] + [
            kind for _, _, chunk in spans for kind in (("chunk", chunk.id), ("separator", None))]
        owners[-1] = ("question", None)
        return self._cut(text, cuts[1:], owners)

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
