"""Finding remembered passages in a message stays linear in the message: no pairwise overlap
test between occurrences, and a passage counts at most MAX_HITS_PER_PASSAGE times per message.
Work is counted (spans compared), never timed."""

from __future__ import annotations

from ragcache_integrations import recovery
from ragcache_integrations.recovery import MAX_HITS_PER_PASSAGE, Candidate, recover


def test_a_passage_repeated_through_a_huge_message_is_counted_a_bounded_number_of_times():
    found = recover("a" * 800_000, [Candidate("a" * 16)])
    assert found is not None and len(found.chunks) == MAX_HITS_PER_PASSAGE
    assert found.render() == "a" * 800_000  # nothing lost: the rest stays text


def test_overlap_checks_grow_as_n_log_n_in_the_occurrences(monkeypatch):
    """Every occurrence is tested against its two neighbours among the chosen spans (a bisect),
    not against every span taken so far: count the bisects and the spans each one looks at."""
    looked: list[int] = []
    real = recovery.bisect.bisect_right

    def counting(starts, start):
        looked.append(len(starts))
        return real(starts, start)

    monkeypatch.setattr(recovery.bisect, "bisect_right", counting)
    passages = [Candidate(f"passage number {i:04d} says something. ") for i in range(400)]
    text = "".join(p.text for p in passages) * 4
    found = recover(text, passages, max_hits=4)
    assert found is not None and len(found.chunks) == 1600
    assert len(looked) == 1600  # one bisect per occurrence, over at most the spans chosen so far


def test_longer_passages_still_win_and_order_is_kept():
    long, short = Candidate("The river flows north into the sea at Alexandria."), Candidate("flows north into the sea")
    found = recover(f"Context: {long.text} And again: {short.text}.", [short, long])
    assert found is not None and [c.text for c in found.chunks if c.text in (long.text, short.text)] == [
        long.text, short.text]
