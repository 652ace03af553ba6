"""Next-token choice and incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_sidecar.errors import NON_FINITE_MESSAGE, NonFiniteLogitsError
from ragcache_integrations.types import SamplingParams

# Below this temperature sampling is greedy (vLLM uses the same floor): logits divided by a
# smaller number overflow to infinity, softmax turns them into NaN, and no token can be drawn.
GREEDY_BELOW = 1e-5


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token: greedy at a temperature below GREEDY_BELOW, else drawn from the tempered,
    top-p-cut distribution. NaN or +inf among the logits raises NonFiniteLogitsError (-inf is a
    masked token and fine); greedy reads the check and the choice back in one host sync."""
    # the max propagates NaN and is +inf if any logit is, and -inf only if every logit is
    finite = torch.isfinite(logits.max())
    if params.temperature < GREEDY_BELOW:
        token_id, ok = torch.stack([torch.argmax(logits), finite.to(torch.long)]).tolist()
        if not ok:
            raise NonFiniteLogitsError(NON_FINITE_MESSAGE)
        return int(token_id)
    if not bool(finite):
        raise NonFiniteLogitsError(NON_FINITE_MESSAGE)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if generator is not None and generator.device != probs.device:
        probs = probs.cpu()  # a seeded request's generator is a CPU one: the same draw on every device
    try:
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    except RuntimeError:  # finite logits so large that dividing by the temperature overflowed
        raise NonFiniteLogitsError(NON_FINITE_MESSAGE) from None


class TextAccumulator:
    """Turns generated ids into text deltas, holding back what could still become a stop string
    or an incomplete UTF-8 character, and cuts the text at the first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        self.text = self.decode(self.ids)
        for stop in self.stops:
            cut = self.text.find(stop)
            if cut != -1:
                self.text = self.text[:cut]
                self.stopped = True
        if self.stopped:
            return self.finish()
        safe_end = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):
            safe_end = min(safe_end, len(self.text) - 1)
        if safe_end <= self.emitted:
            return ""
        delta = self.text[self.emitted : safe_end]
        self.emitted = safe_end
        return delta

    def finish(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
