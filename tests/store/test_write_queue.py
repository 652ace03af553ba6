"""The background writer the disk and Redis tiers share (store/write_queue.py): drops over its byte
bound instead of blocking, bounded flush, take-back of queued and running items, a failing item
never stops the writer."""

from __future__ import annotations

import threading

from engine_sidecar.store.write_queue import WriteQueue


class Gate:
    """A `run` that records what it ran and holds the writer until released."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, key: str, item: int) -> None:
        self.started.set()
        assert self.release.wait(30)
        self.ran.append(key)


def test_an_item_over_the_byte_bound_is_dropped_but_an_empty_queue_takes_any():
    gate = Gate()
    queue: WriteQueue[int] = WriteQueue("test-writer", gate, max_pending_bytes=10)
    assert queue.put("big", 0, 50)  # alone: accepted although over the bound
    assert gate.started.wait(30)  # now running, the queue is empty again
    assert queue.put("a", 0, 6) and not queue.put("b", 0, 6) and queue.put("c", 0, 4)
    gate.release.set()
    assert queue.flush(30) and gate.ran == ["big", "a", "c"] and queue.in_flight == 0


def test_flush_gives_up_after_its_bound_and_succeeds_once_the_writer_moves():
    gate = Gate()
    queue: WriteQueue[int] = WriteQueue("test-writer", gate, max_pending_bytes=100)
    queue.put("a", 0, 1)
    assert queue.flush(0.2) is False
    gate.release.set()
    assert queue.flush(30) is True


def test_discard_takes_back_queued_items_and_cancels_the_running_one_before_flush_returns():
    gate, undone = Gate(), []
    queue: WriteQueue[int] = WriteQueue("test-writer", gate, max_pending_bytes=100, on_cancelled=undone.append)
    queue.put("a", 0, 1)
    assert gate.started.wait(30)
    queue.put("b", 0, 1)
    queue.put("c", 0, 1)
    assert queue.discard({"a", "b"}) == 2 and queue.discard({"zz"}) == 0
    gate.release.set()
    assert queue.flush(30)
    assert gate.ran == ["a", "c"] and undone == ["a"]
    queue.put("a", 0, 1)  # queued again later: not cancelled any more
    assert queue.flush(30) and undone == ["a"]


def test_clear_drops_every_queued_item():
    gate = Gate()
    queue: WriteQueue[int] = WriteQueue("test-writer", gate, max_pending_bytes=100)
    for key in "abc":
        queue.put(key, 0, 1)
    assert gate.started.wait(30)
    queue.clear()
    gate.release.set()
    assert queue.flush(30) and gate.ran == ["a"]


def test_a_failing_item_never_stops_the_writer():
    ran: list[str] = []

    def run(key: str, item: int) -> None:
        if key == "bad":
            raise RuntimeError("boom")
        ran.append(key)

    queue: WriteQueue[int] = WriteQueue("test-writer", run, max_pending_bytes=100)
    queue.put("bad", 0, 1)
    queue.put("good", 0, 1)
    assert queue.flush(30) and ran == ["good"]
