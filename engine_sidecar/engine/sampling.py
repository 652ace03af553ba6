"""Next-token choice and incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine_sidecar.errors import NON_FINITE_MESSAGE, NonFiniteLogitsError
from ragcache_integrations.types import SamplingParams

# Below this temperature sampling is greedy (vLLM uses the same floor): logits divided by a
# smaller number overflow to infinity, softmax turns them into NaN, and no token can be drawn.
GREEDY_BELOW = 1e-5


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token: greedy at a temperature below GREEDY_BELOW, else drawn from the tempered,
    top-p-cut distribution. NaN or +inf among the logits raises NonFiniteLogitsError (-inf is a
    masked token and fine)."""
    choice = choose_tokens(logits[None], [params], [generator])[0]
    if isinstance(choice, Exception):
        raise choice
    return choice


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> list[int | NonFiniteLogitsError]:
    """Each row's next token ([B, V] logits, one row per sequence), with NonFiniteLogitsError in
    the place of a row whose logits hold NaN or +inf (or overflow once tempered). Every greedy and
    every unseeded row is chosen on the device and read back together with its finite check: one
    host sync for the whole batch. A seeded row draws on its CPU generator (the same draw on every
    device), a read of its own."""
    out: list[int | NonFiniteLogitsError | None] = [None] * len(params)
    picked: list[int] = []
    tokens: list[torch.Tensor] = []
    checks: list[torch.Tensor] = []
    greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_BELOW]
    if greedy:
        rows = logits[greedy] if len(greedy) < logits.shape[0] else logits
        picked += greedy
        tokens.append(rows.argmax(dim=-1))
        # the max propagates NaN and is +inf if any logit is, and -inf only if every logit is
        checks.append(torch.isfinite(rows.max(dim=-1).values))
    for i, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.temperature < GREEDY_BELOW:
            continue
        if generator is not None:
            out[i] = _seeded_draw(logits[i], p, generator)
            continue
        probs, ok = _tempered(logits[i], p)
        # a NaN never reaches multinomial: on a GPU that is a device-side assert, fatal to the
        # process; the row is drawn from a stand-in and its check reports the fault instead
        safe = torch.where(ok, probs, torch.ones_like(probs))
        picked.append(i)
        tokens.append(torch.multinomial(safe / safe.sum(), 1))
        checks.append(ok[None])
    if picked:
        values, finite = torch.stack([torch.cat(tokens), torch.cat(checks).to(torch.long)]).tolist()
        for i, token, ok in zip(picked, values, finite, strict=True):
            out[i] = int(token) if ok else NonFiniteLogitsError(NON_FINITE_MESSAGE)
    return [choice for choice in out if choice is not None]


def _tempered(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tempered, top-p-cut probabilities, a device flag: the logits were finite and stayed
    so once divided by the temperature)."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        # masked_fill, not a boolean index: that one reads the mask's count back
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(outside, 0.0))
    total = probs.sum()
    return probs, torch.isfinite(logits.max()) & torch.isfinite(total) & (total > 0)


def _seeded_draw(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator) -> int | NonFiniteLogitsError:
    probs, ok = _tempered(logits, params)
    if not bool(ok):
        return NonFiniteLogitsError(NON_FINITE_MESSAGE)
    if generator.device != probs.device:
        probs = probs.cpu()  # a seeded request's generator is a CPU one: the same draw on every device
    try:
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    except RuntimeError:  # no row of a batch may fail the others
        return NonFiniteLogitsError(NON_FINITE_MESSAGE)


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
