"""Property tests (hypothesis) for the conversation store: after any sequence of puts, gets,
drops, clears and clock steps the count, token and byte bounds hold, nothing older than the TTL
is ever returned, and the least recently used conversation is the one that goes first."""

from __future__ import annotations

from collections import OrderedDict

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_sidecar.reuse.conversation import Conversation, ConversationStore
from engine_sidecar.store.entry import ChunkKV

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKEN_BYTES = ChunkKV(torch.zeros(2, 1, 1, 2), torch.zeros(2, 1, 1, 2), torch.zeros(1, dtype=torch.long)).nbytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def conversation(tenant: str, cid: str, n: int) -> Conversation:
    history = ChunkKV(torch.randn(2, n, 1, 2), torch.randn(2, n, 1, 2), torch.arange(n), None, tenant)
    return Conversation(tenant, cid, "system", history)


KEYS = [(t, c) for t in ("", "t1") for c in ("a", "b", "c")]
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), st.integers(1, 12)),
    st.tuples(st.just("get"), st.sampled_from(KEYS)),
    st.tuples(st.just("drop"), st.sampled_from(KEYS)),
    st.tuples(st.just("tick"), st.floats(0.0, 40.0)),
    st.tuples(st.just("clear"), st.sampled_from([None, "", "t1"])),
), max_size=50)


@SETTINGS
@given(ops=ops, max_tokens=st.integers(1, 10), max_conversations=st.integers(0, 4),
       max_bytes_tokens=st.integers(1, 30), ttl=st.floats(5.0, 60.0))
def test_conversation_store_bounds_ttl_and_lru_hold_after_any_sequence(ops, max_tokens, max_conversations,
                                                                       max_bytes_tokens, ttl):
    clock = Clock()
    max_bytes = max_bytes_tokens * TOKEN_BYTES
    store = ConversationStore(ttl_s=ttl, max_tokens=max_tokens, max_conversations=max_conversations,
                              max_bytes=max_bytes, clock=clock)
    model: OrderedDict[tuple[str, str], tuple[Conversation, float]] = OrderedDict()  # LRU first

    def expire() -> None:
        for key in [k for k, (_, used) in model.items() if clock.now - used > ttl]:
            del model[key]

    for op in ops:
        if op[0] == "put":
            _, key, n = op
            conv = conversation(*key, n)
            expire()
            model.pop(key, None)
            fits = n <= max_tokens and conv.history.nbytes <= max_bytes and max_conversations >= 1
            assert store.put(conv) == fits
            if fits:
                model[key] = (conv, clock.now)
                while len(model) > max_conversations or sum(c.history.nbytes for c, _ in model.values()) > max_bytes:
                    model.popitem(last=False)
        elif op[0] == "get":
            expire()
            got = store.get(*op[1])
            want = model.get(op[1])
            assert (got is None) == (want is None)
            if want is not None:
                assert got is want[0]
                model[op[1]] = (want[0], clock.now)
                model.move_to_end(op[1])
        elif op[0] == "drop":
            assert store.drop(*op[1]) == (model.pop(op[1], None) is not None)
        elif op[0] == "tick":
            clock.now += op[1]
        else:
            tenant = op[1]
            gone = [k for k in model if tenant is None or k[0] == tenant]
            for k in gone:
                del model[k]
            assert store.clear(tenant) == len(gone)
        held = list(store._items.values())
        assert [(c.tenant, c.conversation_id) for c in held] == list(model)  # LRU order
        assert len(store) <= max(0, max_conversations)
        assert store.bytes == sum(c.history.nbytes for c in held) <= max_bytes
        assert all(c.num_tokens <= max_tokens for c in held)


def test_a_read_conversation_is_not_expired_under_its_reader():
    """Regression: `get` moved a conversation to the LRU end but left its TTL clock at the last
    put, so a conversation read every few minutes (each turn failing or still running) expired
    while being used, and TTL and LRU order disagreed."""
    clock = Clock()
    store = ConversationStore(ttl_s=10.0, clock=clock)
    store.put(conversation("", "a", 3))
    for _ in range(5):
        clock.now += 8.0
        assert store.get("", "a") is not None
    clock.now += 10.5
    assert store.get("", "a") is None and store.bytes == 0


def test_expired_conversations_stop_counting_when_the_next_one_is_put():
    """Puts expire too: a store written to but rarely read must not hold expired KV against its
    byte budget (and evict a live conversation for it)."""
    clock = Clock()
    store = ConversationStore(ttl_s=10.0, max_bytes=10 * TOKEN_BYTES, clock=clock)
    store.put(conversation("", "old", 6))
    clock.now += 11.0
    store.put(conversation("", "live", 3))
    store.put(conversation("", "new", 6))  # fits only once the expired one no longer counts
    assert store.get("", "live") is not None and store.get("", "new") is not None
    assert store.get("", "old") is None
