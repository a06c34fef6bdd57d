"""Which open locks on a node are stale: SGLang's tree counts locks, not holders, so the number its
live holders hold decides how many; the live are their own, then the unnamed, then the oldest."""

from __future__ import annotations

from kvscope.probe.sglang import stale_locks


def test_a_live_requests_own_lock_is_kept_and_a_finished_ones_is_stale() -> None:
    held = [("req-B", 4), ("req-D", 6)]
    assert stale_locks(held, {"req-D"}, 1) == [("req-B", 4)]


def test_a_lock_taken_outside_any_request_counts_for_a_live_holder_before_a_named_finished_one() -> None:
    held = [("req-B", 4), (None, 6)]
    assert stale_locks(held, {"req-D"}, 1) == [("req-B", 4)]


def test_as_many_stale_as_the_tree_counts_beyond_its_live_holders() -> None:
    held = [(None, 2), ("req-B", 4), ("req-C", 5)]
    assert stale_locks(held, set(), 0) == held
    assert stale_locks(held, {"req-D"}, 2) == [("req-C", 5)]  # the oldest named one is taken as the live lock
