"""Kernels compiled before the first request: one full, one reused and one fused prefill and two
decode steps of a made-up prompt, run through fused prefill and batched decode as a request's
would be.

On a GPU the Triton kernels compile on their first launch of each variant, a cost that would land
on whichever request meets a variant first. Their sizes are not specialised, so a handful of
launches covers what requests launch: attention over every row and over a few rows with split
keys, CacheBlend's recompute, decode with and without split keys. Nothing touches the chunk
store: the prompt's KV lives in buffers of its own and is dropped afterwards."""

from __future__ import annotations

import time

import torch

from engine_sidecar.execution.batched_decode import decode_batch
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy
from engine_sidecar.execution.policies.plain import FullPolicy, ReusePolicy
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.store.entry import ChunkKV

# Long enough that a few query rows split their keys on a GPU (four splits of 4 x 64 keys); the
# short prompt's decode does not split.
LONG_TOKENS = 1024
SHORT_TOKENS = 64
CHUNKS = 4
QUESTION_TOKENS = 16


def made_up_ids(count: int, vocab: int, seed: int) -> tuple[int, ...]:
    """`count` random token ids of the model's vocabulary, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    # away from the low ids, where models keep their special tokens
    return tuple(torch.randint(min(16, vocab - 1), vocab, (count,), generator=generator).tolist())


def full_kv(runner: ModelRunner, ids: tuple[int, ...]) -> KVBuffer:
    """The KV of `ids` from a full prefill, with room for two decode steps."""
    plan = FusionPlan([PlanSpan("question", 0, ids, "fresh")], "full")
    return fused_prefill(runner, plan, FullPolicy(), capacity=len(ids) + 2).kv


def fused_plan(ids: tuple[int, ...], kv: KVBuffer) -> FusionPlan:
    """The prompt's chunks in reverse order at new positions, their KV from `kv`, and a question."""
    body = len(ids) - QUESTION_TOKENS
    bounds = [body * i // CHUNKS for i in range(CHUNKS + 1)]
    spans, start = [], 0
    for lo, hi in reversed(list(zip(bounds, bounds[1:], strict=False))):
        cached = ChunkKV(kv.keys_pre[:, lo:hi].clone(), kv.values[:, lo:hi].clone(),
                         torch.tensor(ids[lo:hi], dtype=torch.int64))
        spans.append(PlanSpan("chunk", start, ids[lo:hi], "fuse", cached))
        start += hi - lo
    spans.append(PlanSpan("question", start, ids[body:], "fresh"))
    return FusionPlan(spans, "warm-up")


def warm_kernels(runner: ModelRunner, long_tokens: int = LONG_TOKENS, short_tokens: int = SHORT_TOKENS) -> float:
    """Run the made-up prompts; the seconds it took (on a GPU, mostly compiling)."""
    started = time.perf_counter()
    vocab = runner.config.vocab_size
    # within the model's context, with room for the decode steps
    long_tokens = min(long_tokens, runner.config.max_position_embeddings - 4)
    short_tokens = min(short_tokens, long_tokens // 2)
    long_ids, short_ids = made_up_ids(long_tokens, vocab, 0), made_up_ids(short_tokens, vocab, 1)
    with torch.inference_mode():
        long_kv = full_kv(runner, long_ids)
        plan = fused_plan(long_ids, long_kv)
        for policy in (ReusePolicy(), CacheBlendPolicy(0.15)):
            fused_prefill(runner, plan, policy, capacity=long_tokens + 2)
        short_kv = full_kv(runner, short_ids)
        decode_batch(runner, [long_kv], [long_ids[0]])
        decode_batch(runner, [short_kv, long_kv], [short_ids[0], long_ids[0]])
        decode_batch(runner, [short_kv], [short_ids[0]])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - started
