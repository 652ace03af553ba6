"""FusionPlan: which token spans are reused exactly, reused at new positions, or computed.

The planner produces it, the executor runs it, and `describe()` prints it for a user who asks
why a request was slow (`--explain`, `stats.plan`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine_sidecar.store.entry import ChunkKV

SpanMode = Literal["exact", "fuse", "fresh"]


@dataclass
class PlanSpan:
    kind: str  # prefix | chunk | question
    start: int
    token_ids: tuple[int, ...]
    mode: SpanMode  # exact: cached at these very positions; fuse: cached elsewhere; fresh: no cache
    cached: ChunkKV | None = None
    chunk_id: str | None = None
    recompute: torch.Tensor | None = None  # local token indices a policy recomputes (Cache-Craft)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class FusionPlan:
    spans: list[PlanSpan]
    policy: str
    notes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.spans[-1].end if self.spans else 0

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.spans for t in s.token_ids]

    def token_tensor(self) -> torch.Tensor:
        """Every token id as an int64 tensor on the host. Made through an int64 array: `torch.tensor`
        of a list converts the Python ints one by one, which a long prompt pays on its host path."""
        ids = array("q")
        for span in self.spans:
            ids.extend(span.token_ids)
        return torch.frombuffer(ids, dtype=torch.int64) if ids else torch.zeros(0, dtype=torch.int64)

    def describe(self) -> list[dict[str, object]]:
        return [
            {"kind": s.kind, "chunk_id": s.chunk_id, "positions": [s.start, s.end], "mode": s.mode}
            for s in self.spans
        ]
