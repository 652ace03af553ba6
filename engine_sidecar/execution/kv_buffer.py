"""A sequence's KV for every layer: keys before and after RoPE and values, preallocated so decode
appends in place. Fused prefill fills it, batched decode grows it, the KV pool recycles it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_sidecar.model.runner import ModelRunner


@dataclass
class KVBuffer:
    """A sequence's KV for every layer, preallocated to `capacity` so decode grows in place."""

    keys_pre: torch.Tensor  # [L, cap, Hkv, D] before RoPE (what the store keeps)
    keys: torch.Tensor  # [L, cap, Hkv, D] rotated to global positions
    values: torch.Tensor  # [L, cap, Hkv, D]
    length: int = 0
    # the flat tensors these are views of, where a KVPool handed the buffer out (it takes them back)
    storage: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, runner: ModelRunner, capacity: int) -> KVBuffer:
        c = runner.config
        shape = (c.num_layers, capacity, c.num_kv_heads, c.head_dim)
        kw = {"dtype": runner.dtype, "device": runner.device}
        return cls(torch.empty(shape, **kw), torch.empty(shape, **kw), torch.empty(shape, **kw))

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def same_layout(self) -> bool:
        """The three buffers share their strides (as allocated): one kernel can write all three."""
        return self.keys_pre.stride() == self.keys.stride() == self.values.stride()

    def ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        grow = max(needed, 2 * self.capacity) - self.capacity
        pad = (0, 0, 0, 0, 0, grow)
        self.storage = None  # new tensors: the pooled storage is no longer what they view
        self.keys_pre = torch.nn.functional.pad(self.keys_pre, pad)
        self.keys = torch.nn.functional.pad(self.keys, pad)
        self.values = torch.nn.functional.pad(self.values, pad)
