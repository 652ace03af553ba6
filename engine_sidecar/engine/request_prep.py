"""A request before it is queued: parsed and validated (clear errors, on the caller's thread),
its chunks counted in the CA-Table and put in the requested order."""

from __future__ import annotations

from collections.abc import Mapping

from engine_sidecar.errors import InvalidPromptError, PromptTooLongError
from engine_sidecar.execution.policies import Policy, parse_policy
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import PromptBuilder, Segment
from engine_sidecar.request.reorder import ChunkAccessTable, access_key, check_order
from engine_sidecar.reuse.planner import IN_CONTEXT
from engine_sidecar.store.chunk_store import ChunkStore
from ragcache_integrations.types import Chunk, ChunkedPrompt, SamplingParams


class RequestPreparer:
    def __init__(self, builder: PromptBuilder, access_table: ChunkAccessTable, store: ChunkStore, keys: KeyFactory,
                 max_context: int, temperatures: Mapping[str, float] | None = None, vocab_size: int | None = None):
        self.builder, self.access_table, self.store, self.keys = builder, access_table, store, keys
        self.max_context, self.vocab_size = max_context, vocab_size
        # policy name -> the attention temperature a spec without tempT gets (calibration.py)
        self.temperatures = dict(temperatures or {})

    def check_chunk_fits(self, seg: Segment, index: int | None = None) -> None:
        if len(seg.token_ids) >= self.max_context:
            where = f"chunks[{index}]" if index is not None else f"chunk {seg.chunk_id}"
            raise PromptTooLongError(
                f"{where} has {len(seg.token_ids)} tokens, more than the model's context window "
                f"({self.max_context}); split it into smaller chunks"
            )

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Stop token ids must name tokens of this model's vocabulary."""
        vocab = self.vocab_size
        for i, token_id in enumerate(sampling.stop_token_ids):
            if vocab is not None and token_id >= vocab:
                raise InvalidPromptError(f"sampling.stop_token_ids[{i}] is {token_id}; this model's token ids are "
                                         f"0 to {vocab - 1}")

    def prepare(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None,
                 policy: str | Policy, order: str, tenant: str) -> tuple[ChunkedPrompt, SamplingParams, Policy]:
        prompt = prompt if isinstance(prompt, ChunkedPrompt) else ChunkedPrompt.model_validate(prompt)
        sampling = sampling if isinstance(sampling, SamplingParams) else SamplingParams.model_validate(sampling or {})
        self.check_sampling(sampling)
        # a Policy the caller passes is a frozen spec: the request's selection is its own
        pol = policy if isinstance(policy, Policy) else parse_policy(policy, self.temperatures)
        check_order(order)
        # counts are per tenant: one tenant's traffic must not reorder (or reveal) another's chunks
        self.access_table.record([access_key(tenant, c.id or "") for c in prompt.chunks])
        if prompt.chunks and prompt.messages is None:
            # (a verbatim prompt's chunks sit where the app's text put them: it cannot be reordered)
            if order == "frequency":
                prompt = prompt.model_copy(update={"chunks": self.access_table.sort(
                    prompt.chunks, lambda c: access_key(tenant, c.id or ""))})
            elif order in ("hits-first", "misses-first"):
                held, new = self.split_held(prompt, tenant)
                prompt = prompt.model_copy(update={"chunks": held + new if order == "hits-first" else new + held})
        return prompt, sampling, pol

    def split_held(self, prompt: ChunkedPrompt, tenant: str) -> tuple[list[Chunk], list[Chunk]]:
        """(chunks whose KV the store holds (computed in place earlier, or warmed), the others),
        each in the retriever's order. `misses-first` puts the new ones first: a token's
        attention reads every key before it, so a chunk computed in full costs least early in
        the prompt, and computed right after the system prefix its KV is what a precompute
        would store."""
        prefix = self.builder.prefix_segment(prompt.system)
        context = self.keys.chunk_context(prefix)

        def held(chunk: Chunk) -> bool:
            ids = self.builder.chunk_segment(chunk).token_ids
            return (self.store.contains(self.keys.for_tokens(ids, tenant, IN_CONTEXT))
                    or self.store.contains(self.keys.for_tokens(ids, tenant, context)))

        flags = [held(c) for c in prompt.chunks]
        return ([c for c, f in zip(prompt.chunks, flags, strict=True) if f],
                [c for c, f in zip(prompt.chunks, flags, strict=True) if not f])

    def check_total(self, total: int, max_tokens: int) -> None:
        if total + max_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt has {total} tokens and max_tokens is {max_tokens}: together more than the "
                f"model's context window ({self.max_context}); send fewer or shorter chunks or lower max_tokens"
            )

    def validate(self, prompt: ChunkedPrompt, max_tokens: int) -> int:
        """The prompt's token count, after checking it fits the context window."""
        assembled = self.builder.build(prompt)
        for i, seg in enumerate(s for s in assembled.segments if s.kind == "chunk"):
            self.check_chunk_fits(seg, i)
        self.check_total(len(assembled), max_tokens)
        return len(assembled)
