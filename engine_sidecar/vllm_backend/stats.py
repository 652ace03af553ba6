"""ragcache's per-request stats with `--engine vllm`: what the connector reports, mapped onto
the sidecar's GenerationStats.

The connector's worker appends one JSON line per request to a stats file (connector_config's
`stats_path`) in the forward pass that completes the prompt, so before the request's first
token. That file is the one source used here, for streamed and non-streamed requests alike: the
sidecar always streams from vLLM (a client that leaves or times out stops vLLM at the next token),
and a non-streamed vLLM response's `kv_transfer_params` loses the stats of a request that ends in
the step that completes its prompt (max_tokens 1, an immediate stop)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ragcache_integrations.types import GenerationStats


class ConnectorStats:
    """Tails the stats file; `take(request_id)` returns and forgets one request's line."""

    def __init__(self, path: Path, keep: int = 10_000):
        self.path, self.keep = path, keep
        self._offset = 0
        self._lines: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, request_id: str, wait_s: float = 0.5) -> dict[str, Any] | None:
        """The line of the vLLM request whose id starts with `request_id` (vLLM appends its own
        suffixes), waiting up to `wait_s` for it to appear."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                self._read_new()
                found = next((rid for rid in self._lines if rid.startswith(request_id)), None)
                if found is not None:
                    return self._lines.pop(found)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _read_new(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._offset += end
        for raw in data[:end].splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            self._lines[str(line.pop("request_id", ""))] = line
        while len(self._lines) > self.keep:  # lines of requests nobody asked for (cancelled ones)
            self._lines.popitem(last=False)


def vllm_request_stats(policy: str, prompt_tokens: int, cached_tokens: int, connector: dict[str, Any] | None,
                       ttft_s: float, decode_tokens: int, times: dict[str, float], history: int = 0) -> GenerationStats:
    """GenerationStats from vLLM's usage and the connector's line. vLLM counts the tokens the
    connector supplied as cached; of those, ragcache recomputed (per the policy) about
    `ragcache_token_layers / layers` token-equivalents and reused the rest; vLLM computed the
    remainder in full. `cached_tokens` beyond the supplied ones are vLLM's own prefix-cache hits."""
    n = max(1, prompt_tokens)
    notes = ["engine vllm: tokens_recomputed counts ragcache's token-layers over the layer count"]
    if connector is None:
        if history:
            notes.append(f"conversation follow-up: {history} history tokens sent to vLLM as a plain request")
        return GenerationStats(ttft_s=ttft_s, prefill_tokens_total=prompt_tokens, tokens_reused=cached_tokens,
                               tokens_computed_fresh=prompt_tokens - cached_tokens,
                               computed_fraction=(prompt_tokens - cached_tokens) / n, decode_tokens=decode_tokens,
                               policy="full" if not history else "prefix", stage_times=times, notes=notes[1:])
    layers = max(1, int(connector.get("layers") or 1))
    supplied = int(connector.get("supplied_tokens") or 0)
    token_layers = int(connector.get("ragcache_token_layers") or 0)
    recomputed = min(supplied, round(token_layers / layers))
    fresh = prompt_tokens - cached_tokens
    chunks, hits = int(connector.get("chunks") or 0), int(connector.get("chunk_hits") or 0)
    computed = token_layers + fresh * layers
    notes.append(f"engine vllm: ragcache supplied {supplied} of {prompt_tokens} prompt tokens, vLLM's prefix cache "
                 f"{max(0, cached_tokens - supplied)}, vLLM computed {fresh}")
    return GenerationStats(ttft_s=ttft_s, prefill_tokens_total=prompt_tokens, tokens_reused=cached_tokens - recomputed,
                           tokens_recomputed=recomputed, tokens_computed_fresh=fresh, chunk_hits=hits,
                           chunk_misses=chunks - hits, computed_fraction=computed / (n * layers),
                           token_layers_computed=computed, decode_tokens=decode_tokens, policy=policy,
                           stage_times=times, notes=notes)
