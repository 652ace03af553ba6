"""Layer-wise prefetch: chunk KV that sits on the disk tier is read a layer at a time by a
thread while the executor computes earlier layers, instead of all of it before layer 0.

Cache-Craft's preload depth: with per-layer compute time t_c and per-layer load time t_l, start
computing once d layers are loaded, where
    d = 1                             if t_l <= t_c (loading keeps ahead by itself)
    d = ceil(L * (1 - t_c / t_l))     otherwise,
so the remaining L - d layers load while the first ones are computed and compute never stalls
mid-way (it waits once, up front, for the shortfall). Times are what the engine measured so far.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from engine_sidecar.execution.plan import FusionPlan


def preload_depth(num_layers: int, compute_per_layer: float | None, load_per_layer: float | None) -> int:
    if num_layers < 1:
        raise ValueError("a model has at least one layer")
    if not compute_per_layer or not load_per_layer or load_per_layer <= compute_per_layer:
        return 1
    return max(1, min(num_layers, math.ceil(num_layers * (1 - compute_per_layer / load_per_layer))))


@dataclass
class PrefetchTimes:
    read_s: float = 0.0  # the thread's time reading layers
    wait_s: float = 0.0  # the executor's time waiting for layers it needed
    depth: int = 1
    tokens: int = 0
    rows_skipped: int = 0  # token rows per layer not read: recomputed from layer 0 (sparse load)


class LayerPrefetcher:
    """Reads every lazily loaded span of a plan into the request's KV buffer, layer by layer, on
    a thread; `wait(layer)` blocks until that layer (and all before it) is in place."""

    def __init__(self, plan: FusionPlan, keys_pre: torch.Tensor, values: torch.Tensor, depth: int = 1,
                 skip: torch.Tensor | None = None):
        """`skip` [T] bool: tokens recomputed on every layer, whose cached rows are never read."""
        self.spans = [s for s in plan.spans if s.cached is not None and s.cached.reader is not None
                      and s.mode != "fresh"]
        self.keys_pre, self.values = keys_pre, values
        self.num_layers = keys_pre.shape[0]
        # per span: the local rows to read, or None for all of them
        self.rows: list[torch.Tensor | None] = []
        for span in self.spans:
            needed = ~skip[span.start : span.end] if skip is not None else None
            self.rows.append(None if needed is None or bool(needed.all()) else needed.nonzero().squeeze(1))
        self.times = PrefetchTimes(depth=depth, tokens=sum(len(s) for s in self.spans),
                                   rows_skipped=sum(len(s) - len(r) for s, r in zip(self.spans, self.rows, strict=True)
                                                    if r is not None))
        self._done = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def __bool__(self) -> bool:
        return bool(self.spans)

    def start(self) -> LayerPrefetcher:
        if self.spans:
            self._thread = threading.Thread(target=self._run, name="ragcache-prefetch", daemon=True)
            self._thread.start()
            self.wait(self.times.depth - 1)
        return self

    def _run(self) -> None:
        started = time.perf_counter()
        # the KV buffer was made under inference mode; a thread starts outside it
        with torch.inference_mode():
            self._read_all()
        self.times.read_s = time.perf_counter() - started

    def _read_all(self) -> None:
        try:
            for layer in range(self.num_layers):
                for span, rows in zip(self.spans, self.rows, strict=True):
                    entry = span.cached
                    if rows is None:
                        keys, values = entry.reader.layer(layer)
                        entry.keys[layer].copy_(keys)
                        entry.values[layer].copy_(values)
                        self.keys_pre[layer, span.start : span.end] = entry.keys[layer]
                        self.values[layer, span.start : span.end] = entry.values[layer]
                        continue
                    for start, end, keys, values in entry.reader.rows(layer, rows):
                        self.keys_pre[layer, span.start + start : span.start + end] = keys
                        self.values[layer, span.start + start : span.start + end] = values
                with self._cond:
                    self._done = layer + 1
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the executor, which raises it in the request
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def wait(self, layer: int) -> None:
        if not self.spans:
            return
        started = time.perf_counter()
        with self._cond:
            while self._done <= layer and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
        self.times.wait_s += time.perf_counter() - started

    def abandon(self) -> None:
        """The prefill stopped before its end: wait for the thread, whatever it read or raised, so
        that it no longer writes into the buffer."""
        if self._thread is not None:
            self._thread.join()

    def finish(self) -> list:
        """Join the thread; the fully read entries (to promote to RAM; sparse ones are not)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return [s.cached for s, rows in zip(self.spans, self.rows, strict=True) if rows is None]
