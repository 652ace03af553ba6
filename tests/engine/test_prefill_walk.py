"""A request's prefill reads in one place: from the scheduler's loop to the first chunk-store read
the call stack passes through few frames (the sequence's `begin`, the reuse cache's `plan`, the
planner), so a newcomer follows plan -> prefill -> sample -> commit without a relay of stages."""

from __future__ import annotations

import traceback

from engine_sidecar.engine.scheduler import Scheduler
from ragcache_integrations import ChunkedPrompt

PASSAGES = ["The Nile flows north into the Mediterranean Sea.", "Mount Fuji is the highest peak in Japan."]
MAX_FRAMES = 6  # the scheduler's dispatch, begin, ReuseCache.plan, Planner.plan, its prefix step, the lookup


def test_first_store_read_is_a_few_frames_below_the_scheduler_loop(tiny_engine, monkeypatch):
    tiny_engine.warm(PASSAGES)
    store = tiny_engine.chunk_store()
    stacks: list[list[str]] = []
    real_get = store.get

    def recording_get(*args, **kwargs):
        stacks.append([frame.name for frame in traceback.extract_stack()])
        return real_get(*args, **kwargs)

    monkeypatch.setattr(store, "get", recording_get)
    tiny_engine.generate(ChunkedPrompt(chunks=PASSAGES, question="Where does the Nile flow?"), {"max_tokens": 2},
                         policy="reuse")
    from_loop = [stack for stack in stacks if Scheduler._step_until_stopped.__name__ in stack]
    assert from_loop, "the request's store reads run on the scheduler's thread"
    first = from_loop[0]
    loop_at = len(first) - 1 - first[::-1].index(Scheduler._step_until_stopped.__name__)
    between = first[loop_at + 1 : -1]  # frames after the loop's, before the recording get
    assert len(between) <= MAX_FRAMES, between
    assert "plan" in between and "begin" in between
