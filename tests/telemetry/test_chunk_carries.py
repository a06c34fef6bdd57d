"""Chunk carries (schema version 11, telemetry/carry.py): each chunk's evictions per step and its net
change to the locks held, so the Evictions page's chart and the Radix tree page's lock holders read one
value per chunk. They must give what every event gives: on random recordings (many chunks, locks held
across them, unlocks with none held, host-tier copies' locks, steps that straddle a chunk), against the
brute-force reads over every event; with chunks written before version 11 (no carries); after `kvscope
upgrade` stored the missing ones; and on a run of the row layout."""

from __future__ import annotations

import random
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvscope.app import main
from kvscope.dashboard.leak_views import held_locks as held_locks_of_events
from kvscope.telemetry import derived
from kvscope.telemetry.events import CopyKind, EventKind, EvictReason, PoolName
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry.test_packed_oracles import V5, record_random_events
from tests.telemetry.test_request_sums import drop_request_sums

SEEDS = (0, 1, 2)
NUM_STEPS = 150


def record_locks_and_evictions(path: Path, seed: int) -> None:
    """Requests that lock nodes and unlock them later (some twice, some never, some unlocking what they
    never locked), host-tier copies locking and unlocking by reason and aux, locks without a node,
    and evictions, flushed at random: many chunks, and steps split across two chunks."""
    rng = random.Random(seed)
    rids = [f"r{i:03d}" for i in range(12)]
    with SQLRecorder(path, level="full") as rec:
        for step in range(NUM_STEPS):
            rec.step = step + rng.choice((0, 0, 0, 7))
            for _ in range(rng.randint(0, 12)):
                node = rng.randint(1, 6)
                roll = rng.random()
                if roll < 0.35:
                    rec.record(EventKind.LOCK, rid=rng.choice(rids), node_id=node)
                elif roll < 0.65:
                    rec.record(EventKind.UNLOCK, rid=rng.choice(rids), node_id=node)
                elif roll < 0.75:
                    kind = rng.choice((EventKind.LOCK, EventKind.UNLOCK))
                    rec.record(kind, node_id=node, reason=rng.choice(list(CopyKind)), aux=rng.randint(0, 2))
                elif roll < 0.78:
                    rec.record(EventKind.LOCK, rid=rng.choice(rids), node_id=rng.choice((None, node)))
                elif roll < 0.95:
                    rec.record(
                        EventKind.EVICT,
                        pool=PoolName.FULL,
                        node_id=node,
                        num_tokens=rng.randint(1, 30),
                        reason=rng.choice(list(EvictReason)),
                    )
                else:
                    rec.record(EventKind.MATCH, rid=rng.choice(rids), node_id=node, num_tokens=3)
                if rng.random() < 0.04:
                    rec.flush()


@pytest.fixture(scope="module", params=SEEDS)
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("carries") / f"random-{request.param}.db"
    record_locks_and_evictions(path, request.param)
    return path


def evictions_of_events(capture: Capture, max_points: int) -> pd.DataFrame:
    """evictions_over_steps as a group-by over every evict event (what it read before version 11)."""
    ev = capture.events(1, kinds=[EventKind.EVICT], limit=None, columns=["step", "t_mono", "num_tokens"])
    lo = int(ev.step.min())
    width = max(1, -(-(int(ev.step.max()) - lo + 1) // max_points))
    out = ev.groupby(((ev.step - lo) // width).to_numpy()).agg(
        step=("step", "max"),
        num_evictions=("seq", "size"),
        evicted_tokens=("num_tokens", "sum"),
        t_mono=("t_mono", "min"),
    )
    out = out.sort_values("step").reset_index(drop=True)
    out["steps"] = width
    return out


def locks_of_events(capture: Capture, step: int) -> pd.DataFrame:
    """The locks held after `step`, replayed from every lock and unlock (the Radix tree page's read
    before version 11)."""
    columns = ["seq", "step", "kind", "rid", "node_id", "aux", "reason"]
    events = capture.events(1, kinds=[EventKind.LOCK, EventKind.UNLOCK], limit=None, columns=columns)
    return held_locks_of_events(events, step).reset_index(drop=True)


def assert_same_reads(path: Path) -> None:
    capture = Capture(path)
    try:
        last = int(capture.packed.chunks(1).last_step.max())
        for max_points in (600, 7, 1):
            pd.testing.assert_frame_equal(
                derived.evictions_over_steps(capture, 1, max_points), evictions_of_events(capture, max_points)
            )
        steps = sorted({-1, 0, 3, last // 3, last // 2, last - 1, last, last + 5})
        held = 0
        for step in steps:
            got, want = derived.held_locks(capture, 1, step), locks_of_events(capture, step)
            pd.testing.assert_frame_equal(got, want, check_dtype=False)
            held += len(want)
        assert held > 0  # the recordings hold locks across chunks
    finally:
        capture.close()


def chunk_carries(path: Path) -> list[tuple[int, bytes | None, bytes | None, bytes | None, bytes | None]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT chunk, evict_steps, lock_carry, request_carry, miss_nodes FROM event_chunks ORDER BY chunk"
        ).fetchall()


def test_carries_give_what_every_event_gives(recorded: Path) -> None:
    chunks = chunk_carries(recorded)
    assert len(chunks) > 20
    assert all(None not in row for row in chunks)
    assert sum(len(carry) > 0 for _, _, carry, _, _ in chunks) > 5  # locks held over a chunk's end
    assert_same_reads(recorded)


def test_every_step_between_two_chunks_reads_the_same(recorded: Path) -> None:
    """Each step at a chunk's edge: the straddling chunk's events are read, the rest carried."""
    capture = Capture(recorded)
    try:
        chunks = capture.packed.chunks(1)
        edges = sorted({int(s) for s in chunks.last_step} | {int(s) - 1 for s in chunks.first_step})
        for step in edges[:: max(1, len(edges) // 25)]:
            pd.testing.assert_frame_equal(
                derived.held_locks(capture, 1, step), locks_of_events(capture, step), check_dtype=False
            )
    finally:
        capture.close()


def test_chunks_without_carries_read_the_same_and_upgrade_stores_them(recorded: Path, tmp_path: Path) -> None:
    older = tmp_path / "older.db"
    shutil.copy(recorded, older)
    with sqlite3.connect(older) as conn:
        conn.execute(
            "UPDATE event_chunks SET evict_steps = NULL, lock_carry = NULL, request_carry = NULL WHERE chunk % 3 = 0"
        )
    assert_same_reads(older)
    done = upgrade(older)
    assert sum(r.summarized for r in done) == -(-len(chunk_carries(recorded)) // 3)
    assert chunk_carries(older) == chunk_carries(recorded)
    assert_same_reads(older)


def test_a_version_10_file_gets_the_carries_from_upgrade(recorded: Path, tmp_path: Path, capsys) -> None:
    """A file of version 10 (no carry columns) reads the same, and `kvscope upgrade` adds and fills them,
    saying how far it is."""
    older = tmp_path / "v10.db"
    shutil.copy(recorded, older)
    with sqlite3.connect(older) as conn:
        conn.execute("ALTER TABLE event_chunks DROP COLUMN evict_steps")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN lock_carry")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN request_carry")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN miss_nodes")
        drop_request_sums(conn)
        conn.execute("UPDATE kvscope_meta SET value = '10' WHERE key = 'schema_version'")
    assert_same_reads(older)
    assert main(["upgrade", str(older)]) == 0
    assert "summar" in capsys.readouterr().out
    assert chunk_carries(older) == chunk_carries(recorded)
    assert_same_reads(older)


def test_a_wrong_carry_is_seen(recorded: Path, tmp_path: Path) -> None:
    """The comparison can fail: a chunk's carry that forgets its held locks and evictions differs."""
    broken = tmp_path / "broken.db"
    shutil.copy(recorded, broken)
    with sqlite3.connect(broken) as conn:
        conn.execute("UPDATE event_chunks SET evict_steps = X'', lock_carry = X'' WHERE length(lock_carry) > 0")
    with pytest.raises(AssertionError):
        assert_same_reads(broken)


@pytest.mark.parametrize("path", V5, ids=[p.stem for p in V5])
def test_a_run_of_the_row_layout_reads_its_events(path: Path) -> None:
    capture = Capture(path)
    try:
        run_id = int(capture.runs().id.iloc[-1])
        assert capture.packed.chunks(run_id).empty
        last = int(capture.step_range(run_id).hi.iloc[0])
        columns = ["seq", "step", "kind", "rid", "node_id", "aux", "reason"]
        events = capture.events(run_id, kinds=[EventKind.LOCK, EventKind.UNLOCK], limit=None, columns=columns)
        for step in (last // 2, last):
            want = held_locks_of_events(events, step).reset_index(drop=True)
            pd.testing.assert_frame_equal(derived.held_locks(capture, run_id, step), want, check_dtype=False)
    finally:
        capture.close()


def test_evict_steps_of_a_chunk_hold_one_record_per_step() -> None:
    from kvscope.telemetry.carry import evict_steps, read_evict_steps

    columns = {
        "step": np.array([4, 4, 5, 9, 9, 9]),
        "num_tokens": np.array([1, 2, 3, 4, 5, 6]),
        "t_mono": np.array([0.5, 0.25, 1.0, 2.0, 1.5, 3.0]),
    }
    records = read_evict_steps(evict_steps(columns, np.array([True, True, False, True, True, False])))
    assert records.tolist() == [(4, 2, 3, 0.25), (9, 2, 9, 1.5)]


def running_of_events(capture: Capture, step: int) -> pd.DataFrame:
    """running_lengths as it read before version 11: every match and end event up to `step`, each
    request's latest match and latest end, then its full-pool allocations since that match."""
    ends = [EventKind.REQUEST_FINISH, EventKind.REQUEST_ABORT, EventKind.REQUEST_RETRACT]
    window = (-(1 << 62), step)
    matches = capture.events(
        1, kinds=[EventKind.MATCH], step_range=window, limit=None, columns=["step", "rid", "num_tokens"]
    )
    latest = matches[matches.rid.notna()].drop_duplicates("rid", keep="last")
    latest = latest.rename(columns={"seq": "mseq", "step": "mstep", "num_tokens": "hit"})
    ended = capture.events(1, kinds=ends, step_range=window, limit=None, columns=["rid"])
    ended = ended[ended.rid.notna()].drop_duplicates("rid", keep="last").rename(columns={"seq": "eseq"})
    live = latest.merge(ended, on="rid", how="left")
    live = live[live.eseq.isna() | (live.eseq < live.mseq)].copy()
    if live.empty:
        return pd.DataFrame({"rid": pd.Series(dtype=object), "seq_len": pd.Series(dtype="int64")})
    allocs = capture.events(
        1,
        kinds=[EventKind.ALLOC],
        step_range=(int(live.mstep.min()), step),
        limit=None,
        columns=["rid", "pool", "num_tokens"],
    )
    allocs = allocs[(allocs.pool == "full") & allocs.rid.isin(list(live.rid))].merge(live[["rid", "mseq"]], on="rid")
    grown = allocs[allocs.seq > allocs.mseq].groupby("rid")["num_tokens"].sum()
    live["seq_len"] = live["hit"] + live["rid"].map(grown).fillna(0).astype("int64")
    return live[["rid", "seq_len"]].sort_values("rid", kind="stable").reset_index(drop=True)


@pytest.mark.parametrize("seed", SEEDS)
def test_running_requests_from_the_carries_equal_the_events(seed: int, tmp_path: Path) -> None:
    path = tmp_path / "random.db"
    record_random_events(path, seed)
    older = tmp_path / "older.db"
    shutil.copy(path, older)
    with sqlite3.connect(older) as conn:
        conn.execute("UPDATE event_chunks SET request_carry = NULL WHERE chunk % 2 = 0")
    for capture in (Capture(path), Capture(older)):
        try:
            last = int(capture.packed.chunks(1).last_step.max())
            chunks = capture.packed.chunks(1)
            edges = sorted({int(s) for s in chunks.last_step} | {int(s) - 1 for s in chunks.first_step})
            running = 0
            for step in [-1, *edges[:: max(1, len(edges) // 12)], last]:
                got, want = derived.running_lengths(capture, 1, step), running_of_events(capture, step)
                pd.testing.assert_frame_equal(got, want, check_dtype=False)
                running += len(want)
            assert running > 0
        finally:
            capture.close()


def test_recent_evictions_read_the_carries_not_the_events(recorded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Overview's live eviction rate (derived.recent_evictions) sums the chunks' evictions per step: it
    decodes no event column (it decoded every event of its window at every refresh), and gives what the
    events give from every step, those that straddle two chunks included."""
    capture = Capture(recorded)
    try:
        last = int(capture.packed.chunks(1).last_step.max())
        evicts = capture.events(1, kinds=[EventKind.EVICT], limit=None, columns=["step", "num_tokens"])
        want = {
            step: (int((evicts.step >= step).sum()), int(evicts.num_tokens[evicts.step >= step].sum()))
            for step in range(-1, last + 3)
        }

        def no_events(*_args: object) -> None:
            raise AssertionError("recent_evictions decoded an event column")

        monkeypatch.setattr(capture.packed, "event_values", no_events)
        monkeypatch.setattr(capture.packed, "prefetch", no_events)
        for step, (num_evictions, tokens) in want.items():
            got = derived.recent_evictions(capture, 1, step).iloc[0]
            assert (int(got.num_evictions), int(got.evicted_tokens)) == (num_evictions, tokens), step
    finally:
        capture.close()
