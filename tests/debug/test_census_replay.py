"""The census replay (kvscope/debug/census_replay.py) on a synthetic probe capture: a pool of six
blocks, written as the vLLM probe writes it (its block events, and at each idle point the census
the probe's own take_census makes of the pool's true state), replays to the stored census at every
idle point: clean, a reference kept behind the pool's back (leaked), a double free (lostref). A
capture that misses an event does not replay to its census, and the difference is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.debug.census_replay import Term, replay_census, stored_term
from kvscope.probe import BlockView, census_checks, take_census
from kvscope.telemetry import Capture, EventKind, EvictReason, PoolName, SQLRecorder

FULL = PoolName.FULL
# the pool's true state at each idle point: ref counts, hashed blocks, the free queue (head first)
STATES = {
    1: ({b: 0 for b in range(1, 7)}, {1, 2}, [3, 4, 5, 6, 1, 2]),
    2: ({1: 0, 2: 0, 3: 0, 4: 1, 5: 0, 6: 0}, {1, 2}, [3, 5, 6, 2, 1]),
    3: ({1: 0, 2: 0, 3: 0, 4: 1, 5: -1, 6: 0}, {1}, [5, 3, 6, 1, 2]),
}
TAKERS = {4: ("r2", 2, "alloc"), 5: ("r3", 3, "alloc"), 2: ("r3", 3, "alloc")}


def write(target: Path, *, drop: EventKind | None = None) -> Path:
    """The probe's capture of three requests (an event of kind `drop` left out)."""
    with SQLRecorder(target, config={"source": {"kind": "probe", "engine": "vllm", "version": "0.32.0"}}) as rec:

        def event(kind: EventKind, rid: str, slots: list[int], **extra: object) -> None:
            if kind != drop:
                rec.record(kind, pool=FULL, rid=rid, num_tokens=len(slots), slots=slots, aux=0, **extra)  # type: ignore[arg-type]

        rec.step = 1  # r1 takes three blocks, caches two, frees all
        event(EventKind.ALLOC, "r1", [1, 2, 3])
        event(EventKind.INSERT, "r1", [1], node_id=1)
        event(EventKind.INSERT, "r1", [2], node_id=2)
        event(EventKind.FREE, "r1", [3, 2, 1])
        census(rec, 1)
        rec.step = 2  # r2 hits block 1, takes block 4; an extra reference on 4 no event shows
        event(EventKind.LOCK, "r2", [1])
        event(EventKind.REVIVE, "r2", [1])
        event(EventKind.ALLOC, "r2", [4])
        event(EventKind.UNLOCK, "r2", [4])
        event(EventKind.FREE, "r2", [1])
        census(rec, 2)
        rec.step = 3  # r3 takes 5 and the cached block 2 (evicted), frees them, then frees 5 again
        event(EventKind.ALLOC, "r3", [5])
        event(EventKind.EVICT, "r3", [2], node_id=2, reason=EvictReason.CAPACITY)
        event(EventKind.ALLOC, "r3", [2])
        event(EventKind.FREE, "r3", [5, 2])
        event(EventKind.UNLOCK, "r3", [5])
        census(rec, 3)
    return target


def census(rec: SQLRecorder, step: int) -> None:
    refs, hashed, queued = STATES[step]
    result = take_census(BlockView(refs, hashed, queued, len(queued)), [], [], set(), TAKERS, {5: ("r3", 3, "free")})
    for check in census_checks(step, result):
        rec.leak_check(check)


def test_the_replay_reproduces_every_stored_census(tmp_path: Path) -> None:
    db = Capture(write(tmp_path / "probe.db"))
    try:
        points = replay_census(db, 1)
    finally:
        db.close()
    assert [p.step for p in points] == [1, 2, 3]
    assert all(p.agrees for p in points), [p.differences() for p in points]
    leaked, lostref = points[2].replayed_terms["leaked"], points[2].replayed_terms["lostref"]
    assert leaked == Term(1, ((4, 1),)) and lostref == Term(1, ((5, -1),))
    assert points[0].replayed_terms["leaked"] == Term(0, ())
    assert points[1].replayed.held == 1 and points[1].replayed.evictable == 2


@pytest.mark.parametrize("drop", [EventKind.FREE, EventKind.INSERT, EventKind.ALLOC])
def test_a_missing_event_does_not_replay_to_the_census(tmp_path: Path, drop: EventKind) -> None:
    db = Capture(write(tmp_path / "probe.db", drop=drop))
    try:
        points = replay_census(db, 1)
    finally:
        db.close()
    assert not all(p.agrees for p in points)
    assert any(p.differences() for p in points)


def test_stored_terms_are_read_from_the_census_text() -> None:
    assert stored_term("leaked", None) == Term(0, ())
    assert stored_term(
        "leaked",
        "2 blocks leaked: block 4 ref 1, accounted 0; last taken by request r-7 (alloc at "
        "step 2); block 9 ref 2, accounted 0; taker not recorded",
    ) == Term(2, ((4, 1), (9, 2)))
    assert stored_term(
        "unqueued", "10 blocks with ref 0 missing from the free queue: 1, 2, 3, 4, 5, 6, 7, 8 (+2 more)"
    ) == Term(10, tuple((b, None) for b in range(1, 9)))
    with pytest.raises(ValueError, match="cannot read"):
        stored_term("qheld", "something else")
