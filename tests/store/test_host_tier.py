"""The host tier behind the device tier: what device memory evicts moves there, comes back on a
hit, and leaves with deletes like every other tier. On a CPU the engine leaves it off (its first
tier is host RAM already), so these tests build the store directly; on a GPU `ragcache bench gpu`
runs the same round trip with the side-stream copies (its guards)."""

from __future__ import annotations

import torch

from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.device_copies import DeviceCopies
from engine_sidecar.store.entry import CacheKey, ChunkKV

LAYERS, TOKENS, HEADS, DIM = 2, 8, 2, 4


def _entry(seed: int, tenant: str = "", chunk_id: str | None = None) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, TOKENS, HEADS, DIM)
    return ChunkKV(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen),
                   torch.arange(TOKENS) + seed, chunk_id or f"c{seed}", tenant)


def _key(seed: int, tenant: str = "") -> CacheKey:
    return CacheKey("model", "tok", f"tokens-{seed}", tenant, "isolated")


ONE = _entry(0).nbytes  # keys + values + token ids of one entry


def _store(device_entries: int, host_entries: int) -> ChunkStore:
    return ChunkStore(device_entries * ONE, None, torch.device("cpu"), host_capacity_bytes=host_entries * ONE)


def test_what_device_memory_evicts_comes_back_from_the_host_tier():
    store = _store(1, 4)
    first, second = _entry(1), _entry(2)
    store.put(_key(1), first)
    store.put(_key(2), second)  # the device tier holds one entry: the first moves to the host tier
    stats = store.stats()
    assert (stats.ram_entries, stats.host_entries, stats.host_demotions) == (1, 1, 1)
    back = store.get(_key(1))
    assert back is not None and back is not first
    assert torch.equal(back.keys, first.keys) and torch.equal(back.values, first.values)
    assert torch.equal(back.token_ids, first.token_ids) and back.chunk_id == "c1"
    stats = store.stats()
    assert (stats.hits_host, stats.misses, stats.hits_ram) == (1, 0, 0)
    # inclusive: the first stays on the host; the second, evicted for it, joins it there
    assert (stats.ram_entries, stats.host_entries, stats.host_demotions) == (1, 2, 2)
    # evicting the first again costs no second copy
    store.get(_key(2))
    assert store.stats().host_demotions == 2 and store.get(_key(1)) is not None


def test_a_holder_of_an_evicted_entry_keeps_its_tensors():
    """A request may still be reading an entry device memory evicts: the host tier holds another
    object, the evicted one is left as it was."""
    store = _store(1, 4)
    held = _entry(1)
    keys, values = held.keys, held.values
    store.put(_key(1), held)
    store.put(_key(2), _entry(2))
    assert held.keys is keys and held.values is values and held.reader is None


def test_the_host_tier_keeps_its_byte_budget_and_the_index_forgets_what_it_drops():
    store = _store(1, 2)
    for seed in range(1, 6):
        store.put(_key(seed), _entry(seed))
    stats = store.stats()
    # the device holds 5; the host the two evicted last (4, 3); 1 and 2 are gone from every tier
    assert stats.host_entries == 2 and stats.host_bytes <= stats.host_capacity_bytes == 2 * ONE
    assert [store.contains(_key(s)) for s in range(1, 6)] == [False, False, True, True, True]
    assert store.get(_key(1)) is None and store.get(_key(2)) is None
    assert set(store.chunk_id_index()) == {"c3", "c4", "c5"}


def test_deletes_reach_the_host_tier():
    store = _store(1, 8)
    for seed, tenant in ((1, "a"), (2, "b"), (3, "a"), (4, "b")):
        store.put(_key(seed, tenant), _entry(seed, tenant))
    assert store.stats().host_entries == 3  # 1, 2, 3 evicted from the device tier
    assert store.delete(chunk_id="c2") == 1
    assert not store.contains(_key(2, "b")) and store.get(_key(2, "b")) is None
    assert store.delete(tenant="a") == 2  # 1 and 3, both only on the host
    assert store.get(_key(1, "a")) is None and store.get(_key(3, "a")) is None
    assert store.contains(_key(4, "b"))
    assert store.delete() == 1 and store.stats().host_entries == 0


def test_a_new_put_replaces_the_host_copy():
    """Recomputed KV for a digest (a damaged entry computed again) must not lose to an old copy
    the host tier still holds."""
    store = _store(1, 4)
    store.put(_key(1), _entry(1))
    store.put(_key(2), _entry(2))  # 1 on the host
    fresh = _entry(1)
    fresh.keys = fresh.keys + 1.0
    store.put(_key(1), fresh)
    store.put(_key(3), _entry(3))  # 1 evicted again: demoted anew, not the old copy touched
    back = store.get(_key(1))
    assert back is not None and torch.equal(back.keys, fresh.keys)


def test_an_entry_too_large_for_the_device_tier_goes_to_the_host():
    store = ChunkStore(ONE // 2, None, torch.device("cpu"), host_capacity_bytes=4 * ONE)
    store.put(_key(1), _entry(1))
    stats = store.stats()
    assert (stats.ram_entries, stats.host_entries) == (0, 1)
    assert store.get(_key(1)) is not None and store.stats().hits_host == 1


def test_without_a_host_tier_eviction_drops_as_before():
    store = ChunkStore(ONE, None, torch.device("cpu"))
    store.put(_key(1), _entry(1))
    store.put(_key(2), _entry(2))
    assert store.host is None and store.get(_key(1)) is None and store.stats().host_capacity_bytes == 0


def test_copies_on_a_cpu_are_other_entry_objects_over_the_same_tensors():
    copies = DeviceCopies(torch.device("cpu"))
    entry = _entry(1)
    entry.meta["warmed"] = "neighbours"
    host = copies.to_host(entry)
    assert host is not entry and host.keys is entry.keys and host.ready is None
    assert host.meta == entry.meta and host.meta is not entry.meta
    host.wait_ready()  # nothing in flight: returns at once
    back = copies.to_device(host)
    assert back is not host and torch.equal(back.values, entry.values)


def test_the_engine_leaves_the_host_tier_off_on_a_cpu(tiny_llama_dir):
    from engine_sidecar.engine.engine import Engine

    with Engine.from_pretrained(tiny_llama_dir, device="cpu", disk=False, host_cache_bytes=1 << 20) as engine:
        assert engine.cache.store.host is None
