"""Chunk KV moved between the engine's device and host RAM without stalling the compute.

On a GPU every move runs on one side CUDA stream: a copy to the host goes into pinned memory
(asynchronous DMA; a pageable `.cpu()` blocks the calling thread and serializes with the kernels
of the default stream), and a copy to the device makes the compute stream wait on an event, so
neither direction is a host sync on a request's path. Whoever reads the host copy on the CPU
(the disk and Redis writers, on their own threads) waits for its event first (`ChunkKV.wait_ready`).

On a CPU the engine's device is host memory: every move is the tensor itself, no copy.
"""

from __future__ import annotations

import dataclasses

import torch

from engine_sidecar.store.entry import ChunkKV


class DeviceCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self.on_gpu = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.on_gpu else None

    def to_host(self, entry: ChunkKV) -> ChunkKV:
        """A copy of `entry` whose KV is in (pinned) host RAM; the device entry is left as it is
        (a request may still be reading it). On a GPU the copy is in flight when this returns:
        its `ready` event says when the host tensors hold the data."""
        if not self.on_gpu or entry.keys.device.type == "cpu":
            return _copy_of(entry, entry.keys, entry.values)
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the KV is whatever the compute stream wrote up to now
        with torch.cuda.stream(self._stream):
            keys, values = _pinned_like(entry.keys), _pinned_like(entry.values)
            keys.copy_(entry.keys, non_blocking=True)
            values.copy_(entry.values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        # the device tensors may be dropped before the copy runs: their memory must not be handed
        # to another tensor until the side stream is done with them
        entry.keys.record_stream(self._stream)
        entry.values.record_stream(self._stream)
        host = _copy_of(entry, keys, values)
        host.ready = ready
        return host

    def to_device(self, entry: ChunkKV) -> ChunkKV:
        """A copy of a host entry on the device, usable by the compute stream's next kernels: the
        compute stream waits for the copy's event (no host sync)."""
        if not self.on_gpu or entry.keys.device == self.device:
            return _copy_of(entry, entry.keys.to(self.device), entry.values.to(self.device))
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            if entry.ready is not None:  # still arriving from an earlier move to the host
                self._stream.wait_event(entry.ready)
            keys = entry.keys.to(self.device, non_blocking=True)
            values = entry.values.to(self.device, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self._stream)
        compute.wait_event(arrived)
        # allocated on the side stream, read and freed on the compute stream
        keys.record_stream(compute)
        values.record_stream(compute)
        return _copy_of(entry, keys, values)


def _pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


def _copy_of(entry: ChunkKV, keys: torch.Tensor, values: torch.Tensor) -> ChunkKV:
    """Another entry object over these tensors: holders of the original never see its tensors
    change under them."""
    return dataclasses.replace(entry, keys=keys, values=values, meta=dict(entry.meta), reader=None, ready=None)
