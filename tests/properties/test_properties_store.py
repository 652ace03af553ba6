"""Property tests (hypothesis) for the RAM tier and the tiered ChunkStore: any sequence of puts,
gets and removes keeps the byte budget, returns what was put unless it was evicted, evicts least
recently used first, counts tensors shared by two entries once, and never leaves a digest in the
chunk-id index that no tier holds."""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.disk import OWNER_FILE
from engine_sidecar.store.entry import CacheKey, ChunkKV
from engine_sidecar.store.ram import RamTier

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYERS, HEADS, DIM = 2, 1, 2


def make_entry(n: int, seed: int, chunk_id: str | None = None, tenant: str = "") -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
    values = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
    return ChunkKV(keys, values, torch.arange(n, dtype=torch.long) + seed, chunk_id, tenant)


def entry_bytes(n: int) -> int:
    return make_entry(n, 0).nbytes


def equal(a: ChunkKV, b: ChunkKV) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.token_ids, b.token_ids)


DIGESTS = [f"d{i}" for i in range(8)]
ram_ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(DIGESTS), st.integers(1, 6), st.integers(0, 1000)),
    st.tuples(st.just("get"), st.sampled_from(DIGESTS)),
    st.tuples(st.just("remove"), st.sampled_from(DIGESTS)),
), max_size=60)


@SETTINGS
@given(ops=ram_ops, capacity_tokens=st.integers(1, 20))
def test_ram_tier_is_an_lru_by_bytes_that_never_exceeds_its_budget(ops, capacity_tokens):
    capacity = entry_bytes(1) * capacity_tokens
    tier = RamTier(capacity)
    model: OrderedDict[str, ChunkKV] = OrderedDict()  # the reference LRU, least recent first
    for op in ops:
        if op[0] == "put":
            _, digest, n, seed = op
            entry = make_entry(n, seed)
            evicted = tier.put(digest, entry)
            model.pop(digest, None)
            expected: list[str] = []
            if entry.nbytes > capacity:
                expected = [digest]
            else:
                model[digest] = entry
                while sum(e.nbytes for e in model.values()) > capacity:
                    expected.append(model.popitem(last=False)[0])
            assert evicted == expected
        elif op[0] == "get":
            got = tier.get(op[1])
            want = model.get(op[1])
            assert (got is None) == (want is None)
            if want is not None:
                assert got is not None and equal(got, want)
                model.move_to_end(op[1])
        else:
            assert tier.remove(op[1]) == (model.pop(op[1], None) is not None)
        assert tier.bytes_used <= capacity
        assert tier.bytes_used == sum(e.nbytes for e in model.values())
        assert [d for d, _ in tier.items()] == list(model)


@SETTINGS
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=12), capacity_tokens=st.integers(6, 40),
       aliases=st.lists(st.integers(0, 11), max_size=12))
def test_ram_tier_counts_tensors_shared_by_two_entries_once(sizes, capacity_tokens, aliases):
    """The engine keeps a CP-Tree node and the chunk's in-context entry over the same tensors:
    the budget holds the memory really used, and a second key over held tensors costs nothing."""
    capacity = entry_bytes(1) * capacity_tokens
    tier = RamTier(capacity)
    for i, n in enumerate(sizes):
        tier.put(f"node{i}", make_entry(n, i))
    for a in aliases:
        held = tier.get(f"node{a}")
        if held is None:
            continue
        before = tier.bytes_used
        assert tier.put(f"ctx{a}", ChunkKV(held.keys, held.values, held.token_ids, "c", "", {"context": "x"})) == []
        assert tier.bytes_used == before
    distinct = {(s.data_ptr(), s.nbytes()) for _, e in tier.items()
                for s in (e.keys.untyped_storage(), e.values.untyped_storage(), e.token_ids.untyped_storage())}
    assert len(tier)  # the newest entry always fits
    assert tier.bytes_used == sum(size for _, size in distinct) <= capacity
    # dropping one of two keys over the same tensors frees nothing
    for digest in [d for d, _ in tier.items() if d.startswith("ctx")]:
        before = tier.bytes_used
        tier.remove(digest)
        if digest.replace("ctx", "node") in tier:
            assert tier.bytes_used == before
        else:
            assert tier.bytes_used < before
    assert tier.bytes_used == sum(e.nbytes for _, e in tier.items())


def test_ram_tier_counts_a_view_by_the_storage_it_keeps_alive():
    """A view of a large buffer keeps the whole buffer in memory: that is what the budget sees."""
    big = torch.randn(LAYERS, 100, HEADS, DIM)
    view = ChunkKV(big[:, :2], big[:, 2:4], torch.arange(2))
    tier = RamTier(1 << 20)
    tier.put("v", view)
    assert tier.bytes_used == big.nbytes + view.token_ids.nbytes


def key(name: str, tenant: str = "") -> CacheKey:
    return CacheKey("m", "t", name, tenant, "isolated")


NAMES = [f"k{i}" for i in range(6)]
CHUNK_IDS = ["a", "b", "c"]
store_ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(NAMES), st.sampled_from(CHUNK_IDS), st.integers(1, 5)),
    st.tuples(st.just("get"), st.sampled_from(NAMES)),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    st.tuples(st.just("delete"), st.sampled_from(CHUNK_IDS)),
), max_size=30)


def check_index(store: ChunkStore) -> None:
    """Every digest the chunk-id index names is held by RAM or disk, under that chunk id."""
    for chunk_id, digests in store.chunk_id_index().items():
        assert digests, chunk_id
        for digest in digests:
            assert digest in store.ram or (store.disk is not None and digest in store.disk), (chunk_id, digest)


def run_store(store: ChunkStore, ops: list[tuple], capacity: int) -> None:
    held: dict[str, ChunkKV] = {}  # what was put last under each name (it may have been evicted since)
    for step, op in enumerate(ops):
        if op[0] == "put":
            _, name, chunk_id, n = op
            entry = make_entry(n, step, chunk_id)
            store.put(key(name), entry)
            held[name] = entry
        elif op[0] == "get":
            got = store.get(key(op[1]))
            if got is not None:  # from RAM or read back from disk: always what was put
                assert equal(got, held[op[1]])
        elif op[0] == "remove":
            store.remove(key(op[1]))
            store.flush()
            assert not store.contains(key(op[1]))
        else:
            store.delete(op[1])
            assert op[1] not in store.chunk_id_index()
        store.flush()
        assert store.ram.bytes_used <= capacity
        if store.disk is not None and store.disk.capacity_bytes:
            assert store.disk.bytes_used <= store.disk.capacity_bytes
        check_index(store)


@SETTINGS
@given(ops=store_ops, capacity_tokens=st.integers(1, 12))
def test_ram_only_store_index_never_keeps_evicted_digests(ops, capacity_tokens):
    capacity = entry_bytes(1) * capacity_tokens
    run_store(ChunkStore(capacity, None, torch.device("cpu")), ops, capacity)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=store_ops, capacity_tokens=st.integers(1, 8), disk_files=st.integers(1, 4))
def test_tiered_store_index_never_keeps_digests_gone_from_every_tier(ops, capacity_tokens, disk_files):
    capacity = entry_bytes(1) * capacity_tokens
    with tempfile.TemporaryDirectory() as tmp:
        # a file of a 5-token entry is about 1.3 KB here: the budget holds a few small files
        store = ChunkStore(capacity, Path(tmp), torch.device("cpu"), disk_capacity_bytes=disk_files * 1200)
        run_store(store, ops, capacity)
        store.flush()


def test_chunk_id_index_forgets_a_digest_ram_evicted(tmp_path):
    """Regression: the index kept every digest ever put; RAM evictions never pruned it."""
    capacity = entry_bytes(2)
    store = ChunkStore(capacity, None, torch.device("cpu"))
    for i in range(50):
        store.put(key(f"k{i}"), make_entry(2, i, f"chunk{i}"))
    assert store.chunk_id_index() == {"chunk49": {key("k49").digest}}


def test_chunk_id_index_forgets_a_digest_the_disk_tier_evicted(tmp_path):
    store = ChunkStore(entry_bytes(2), tmp_path, torch.device("cpu"), disk_capacity_bytes=3000)
    for i in range(20):
        store.put(key(f"k{i}"), make_entry(2, i, f"chunk{i}"))
        store.flush()
    assert store.disk is not None and 0 < len(store.disk) < 20
    held = {d for ds in store.chunk_id_index().values() for d in ds}
    assert held == set(store.disk.digests()) | {d for d, _ in store.ram.items()}


def test_chunk_store_budget_counts_node_and_in_context_entry_once():
    """Regression: a node's entry and the same chunk's in-context entry share tensors; the RAM
    tier charged them twice and evicted other chunks for memory it did not use."""
    one = entry_bytes(4)
    store = ChunkStore(3 * one, None, torch.device("cpu"))
    node = make_entry(4, 1, "c1")
    store.put(key("node"), node)
    store.put(key("ctx"), ChunkKV(node.keys, node.values, node.token_ids, "c1", "", {"context": "in"}))
    store.put(key("other"), make_entry(4, 2, "c2"))
    store.put(key("third"), make_entry(4, 3, "c3"))
    assert store.ram.bytes_used == 3 * one
    assert all(store.contains(key(k)) for k in ("node", "ctx", "other", "third"))


def test_a_removed_entry_never_comes_back_from_a_queued_or_running_write(tmp_path):
    """Regression: `remove` deleted the file but not the write still queued (or under way) for
    it, so the writer put a removed entry back on disk (a Cache-Craft variant the engine had
    evicted, or a chunk removed right after it was computed)."""
    import threading

    from engine_sidecar.store.disk import DiskTier

    tier = DiskTier(tmp_path)
    started, release = threading.Event(), threading.Event()
    real_write = tier._write

    def slow_write(digest: str, entry: ChunkKV) -> None:
        started.set()
        release.wait(30)
        real_write(digest, entry)

    tier._write = slow_write  # type: ignore[method-assign]
    tier.put("aa01", make_entry(2, 1))
    assert started.wait(30)  # "aa01" is being written, "bb02" waits in the queue behind it
    tier.put("bb02", make_entry(2, 2))
    assert tier.remove("aa01") and tier.remove("bb02")
    release.set()
    assert tier.flush(30)
    assert "aa01" not in tier and "bb02" not in tier and tier.bytes_used == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name != OWNER_FILE]
    tier.put("aa01", make_entry(2, 1))  # written again later: kept as usual
    assert tier.flush(30) and "aa01" in tier


def test_delete_counts_an_entry_held_in_ram_and_on_disk_once(tmp_path):
    """Regression: a full delete returned len(RAM) + len(disk), so every chunk held in both tiers
    (all of them, once written) was reported as two chunks deleted."""
    store = ChunkStore(entry_bytes(4) * 4, tmp_path, torch.device("cpu"))
    store.put(key("a"), make_entry(2, 1, "c1"))
    store.put(key("b"), make_entry(2, 2, "c2"))
    store.flush()
    store.ram.remove(key("b").digest)  # "b" now on disk only
    store.put(key("c"), make_entry(2, 3, "c3"))  # "c": RAM, and on disk once flushed
    assert store.delete() == 3
    assert len(store.ram) == 0 and store.disk is not None and len(store.disk) == 0
    for name, chunk_id in (("a", "c1"), ("b", "c2")):  # by chunk id and by tenant: once each too
        store.put(key(name), make_entry(2, 1, chunk_id))
    store.flush()
    assert store.delete("c1") == 1 and store.delete(tenant="") == 1
