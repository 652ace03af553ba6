"""An opt-in drift check in production: for a fraction of the requests that reused KV, full
prefill's first token is computed too and compared with the reused prefill's.

Reuse trades exactness for speed; an operator who wants to see how often that changes an answer
sets `--verify-fraction`. The check runs after the request's first token is out (off its time
to first token, on the engine's thread: it delays the batch's next decode step by one full
prefill), compares the two prefills' most likely first token (sampling temperature plays no
part) and counts the outcome; the request's stats carry it as `verified_first_token`.
Requests are picked by a running credit, so exactly that fraction is checked, deterministically.
"""

from __future__ import annotations

import threading

import torch

from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import FullPolicy
from engine_sidecar.model.runner import ModelRunner


class FirstTokenVerifier:
    def __init__(self, runner: ModelRunner, fraction: float):
        self.runner, self.fraction = runner, fraction
        self.checked = self.agreed = 0
        self._credit = 0.0
        self._lock = threading.Lock()

    def due(self, plan: FusionPlan) -> bool:
        """Whether this request is one of the fraction checked: it reused KV (a full prefill has
        nothing to compare), and the credit reached one request."""
        if self.fraction <= 0 or plan.policy == "full" or all(s.mode == "fresh" for s in plan.spans):
            return False
        with self._lock:
            self._credit += self.fraction
            if self._credit < 1.0:
                return False
            self._credit -= 1.0
            return True

    def check(self, plan: FusionPlan, logits: torch.Tensor) -> bool:
        """Full prefill of the same tokens: does its first token equal the reused prefill's?"""
        token_ids = tuple(t for span in plan.spans for t in span.token_ids)
        full = fused_prefill(self.runner, FusionPlan([PlanSpan("question", 0, token_ids, "fresh")], "full"),
                             FullPolicy(), need_logits=True)
        assert full.logits is not None
        agrees = bool(torch.argmax(full.logits.reshape(-1)) == torch.argmax(logits.reshape(-1)))
        with self._lock:
            self.checked += 1
            self.agreed += agrees
        return agrees
