"""What the chunk store holds: position-free KV of one token span, for every layer."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_sidecar.store.frequency import frequency_scores


@dataclass(frozen=True)
class CacheKey:
    """(model, tokenizer, token ids, tenant, precompute context) -> one hex digest.

    `context` names how the KV was computed: 'isolated', or 'after:<prefix digest>' for the
    after-prefix convention, or 'exact' for spans computed at their final positions.
    """

    model_fp: str
    tokenizer_fp: str
    tokens_digest: str
    tenant: str
    context: str

    @property
    def digest(self) -> str:
        raw = "|".join((self.model_fp, self.tokenizer_fp, self.tokens_digest, self.tenant, self.context))
        return hashlib.blake2b(raw.encode(), digest_size=20).hexdigest()


# the context of chunk KV computed among other passages (in place, or warmed after neighbours)
IN_CONTEXT = "in-context"
# meta key: digest of the tokens a precomputed chunk was computed after, behind the prefix
LEAD_META = "lead"


def finite_kv(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """No NaN or infinity anywhere: KV that held one would poison every later request reading it
    (the softmax of any query that sees a NaN key is NaN). One host sync for both tensors."""
    return bool(finite_kv_flag(keys, values))


def finite_kv_flag(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`finite_kv` as a 0-d bool tensor on the KV's device, not yet read back."""
    return torch.isfinite(keys).all() & torch.isfinite(values).all()


def warmed_after_neighbours(entry: ChunkKV) -> bool:
    return entry.meta.get("warmed") == "neighbours"


@dataclass
class ChunkKV:
    keys: torch.Tensor  # [layers, n, kv_heads, head_dim], before RoPE
    values: torch.Tensor  # [layers, n, kv_heads, head_dim]
    token_ids: torch.Tensor  # [n] int64
    chunk_id: str | None = None
    tenant: str = ""
    meta: dict[str, str] = field(default_factory=dict)
    # set while the KV is still on disk: keys/values are allocated but filled a layer at a time
    # by layer-wise prefetch (store.disk.LayerReader); None once they hold the data
    reader: Any = field(default=None, repr=False, compare=False)
    # CacheTune frequency scores [n] (cutoff 0.5): read from a tier, or computed once by `tune_scores`
    scores: torch.Tensor | None = None
    # `tune_scores` runs on the disk and the Redis writer threads at once: one computes, one waits
    _scores_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    # a host copy still in flight from the device (store.device_copies): the CUDA event recorded
    # after it; None when the tensors already hold the data
    ready: Any = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.token_ids.nbytes

    def wait_ready(self) -> None:
        """Block this thread until an in-flight host copy has landed (a writer thread, never a
        request's)."""
        ready = self.ready  # read once: the disk and the Redis writer may both be here
        if ready is not None:
            ready.synchronize()

    def tune_scores(self) -> torch.Tensor:
        """The CacheTune scores the disk and Redis tiers store beside the KV (float32, CPU). Computed
        once per entry and kept in `scores`: each tier used to run its own rFFT over every layer of
        the same entry, and the CacheTune policy reuses them for the RAM copy too."""
        with self._scores_lock:
            if self.scores is None:
                self.scores = frequency_scores(self.keys.detach().cpu(), self.values.detach().cpu())
            return self.scores.detach().float().cpu()
