"""A finished turn's KV kept as its conversation's history: every prompt and answer token so far,
exact at positions 0..n-1, so the next turn continues from it instead of prefilling it again."""

from __future__ import annotations

import torch

from engine_sidecar.execution.batched_decode import decode_step
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.reuse.conversation import Conversation
from engine_sidecar.reuse.planner import PlannedRequest
from engine_sidecar.store.entry import ChunkKV
from ragcache_integrations.types import ChunkedPrompt


def conversation_after_turn(runner: ModelRunner, prompt: ChunkedPrompt, planned: PlannedRequest, kv: KVBuffer,
                            generated: list[int], tenant: str) -> Conversation:
    token_ids = planned.plan.token_ids + generated
    while kv.length < len(token_ids):  # the last sampled token was never fed back
        decode_step(runner, kv, token_ids[kv.length])
    n = len(token_ids)
    history = torch.tensor(token_ids, dtype=torch.long)
    entry = ChunkKV(kv.keys_pre[:, :n].clone(), kv.values[:, :n].clone(), history, None, tenant)
    previous = planned.conversation
    held = (previous.chunk_digests if previous else set()) | set(planned.chunk_digests)
    return Conversation(tenant, prompt.conversation_id or "", prompt.system, entry, held,
                        turns=(previous.turns + 1) if previous else 1)
