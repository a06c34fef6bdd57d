"""The SQL recorder and the capture store: round trips, levels, crash and concurrency."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import insert, text
from sqlalchemy.exc import OperationalError

from kvscope.telemetry import EventKind, EvictReason, LeakCheck, PoolName, PoolTerms, RequestRecord, UsageSample, schema
from kvscope.telemetry.packed import ITEM_WIDTH
from kvscope.telemetry.queries import ENDED_WITHOUT_CLOSING, Capture
from kvscope.telemetry.recorder import SQLRecorder, decode_slots

ROOT = Path(__file__).resolve().parents[2]


def test_every_event_kind_round_trips_with_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    with SQLRecorder(path, level="full", label="kinds", config={"cache": "radix"}) as recorder:
        for i, kind in enumerate(EventKind):
            recorder.step = i
            recorder.record(
                kind,
                pool=PoolName.SWA if i % 2 else PoolName.FULL,
                rid=f"r{i}",
                node_id=i * 10,
                num_tokens=i + 1,
                slots=np.array([i, i + 1, 70000]),
                reason=EvictReason.TOMBSTONE,
                aux=-i,
                principal=f"u{i}" if i % 3 else None,
            )
    capture = Capture(path)
    frame = capture.events(1)
    assert list(frame.kind) == [k.value for k in EventKind]
    for i, row in enumerate(frame.itertuples()):
        assert (row.seq, row.step, row.rid, row.node_id, row.num_tokens, row.aux) == (i, i, f"r{i}", i * 10, i + 1, -i)
        assert row.pool == ("swa" if i % 2 else "full") and row.reason == "tombstone"
        assert (f"u{i}" if i % 3 else None) == (None if pd.isna(row.principal) else row.principal)
        assert decode_slots(row.slots) == [i, i + 1, 70000]
    run = capture.runs().iloc[0]
    assert (run.status, run.label, run.level) == ("finished", "kinds", "full")
    assert '"cache": "radix"' in run.config
    assert list(capture.events(1, kinds=[EventKind.EVICT, EventKind.LOCK]).kind) == ["lock", "evict"]
    assert len(capture.events(1, step_range=(3, 5))) == 3
    assert list(capture.events(1, rid="r4").seq) == [4]
    assert list(capture.events(1, node_id=20).seq) == [2]


def test_summary_level_keeps_samples_but_no_events(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with SQLRecorder(path, level="summary") as recorder:
        assert recorder.enabled is False
        recorder.usage(UsageSample(1, PoolTerms(64, 40, 20, 4), PoolTerms(32, 30, 1, 1), 8, 7, 1, 0, 10, 4, 1, 1, 0, 0))
        recorder.leak_check(LeakCheck(1, "full", 64, 40, 20, 4, 0, 1))
        req = RequestRecord("r1", "bob", 12, status="finished", cached_tokens=4, output_len=3)
        req.mark("arrive", 0, 1.5)
        req.mark("finish", 9, 2.5)
        recorder.request(req)
    capture = Capture(path)
    assert capture.events(1).empty
    usage = capture.usage(1).iloc[0]
    assert (usage.full_available, usage.swa_total, usage.cum_hit_tokens) == (40, 32, 4)
    leak = capture.leak_checks(1).iloc[0]
    assert not leak.ok and "uncached=1" in leak.message
    row = capture.requests(1).iloc[0]
    assert (row.principal, row.cached_tokens, row.arrive_step, row.finish_step, row.finish_t) == ("bob", 4, 0, 9, 2.5)


def test_usage_is_downsampled_in_sql(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    with SQLRecorder(path, level="summary") as recorder:
        for step in range(1000):
            used = 60 if step == 537 else 10
            recorder.usage(UsageSample(step, PoolTerms(64, 64 - used, 0, 0), None, 1, 1, 0, 0, step, 0, 0, 0, 0, 0))
    frame = Capture(path).usage(1, max_points=50)
    assert len(frame) <= 50
    assert frame.step.max() == 999 and frame.cum_prompt_tokens.max() == 999
    # the one spike (60 of 64 in use, 4 available) survives the cut into buckets
    assert 537 in set(frame.step) and frame.full_available.min() == 64 - 60
    assert frame.full_available.max() == 64 - 10


def test_a_crashing_block_marks_the_run_crashed(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    with pytest.raises(RuntimeError), SQLRecorder(path):
        raise RuntimeError("engine blew up")
    run = Capture(path).runs().iloc[0]
    assert run.status == "crashed" and "engine blew up" in run.error


def test_readers_cannot_write(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    SQLRecorder(path).close()
    before = path.read_bytes()
    capture = Capture(path)
    with pytest.raises(OperationalError, match="readonly"), capture.engine.begin() as conn:
        conn.execute(insert(schema.meta).values(key="x", value="y"))
    assert path.read_bytes() == before


def kill_writer_after(path: Path, num_events: int) -> int:
    """Run tests.telemetry.writer_proc into `path`, SIGKILL it once it reports at least
    `num_events` flushed; returns the count it last reported."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.telemetry.writer_proc", str(path), "100000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    flushed = 0
    for line in proc.stdout:
        flushed = int(line.split()[1])
        if flushed >= num_events:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return flushed


def test_sigkill_leaves_everything_up_to_the_last_flush(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    flushed = kill_writer_after(path, 5000)
    capture = Capture(path)
    seqs = capture.events(1, limit=10_000_000).seq.to_numpy()
    assert len(seqs) >= flushed, "events flushed before the kill are missing"
    assert (seqs == np.arange(len(seqs))).all(), "a gap in the event sequence"
    run = capture.runs().iloc[0]
    assert run.status == "running" and run.display_status == ENDED_WITHOUT_CLOSING


def test_reader_reads_while_a_writer_process_writes_and_sigterm_finishes(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.telemetry.writer_proc", str(path), "100000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    capture = Capture(path)
    seen = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        seen.append(capture.last_event_seq(1) + 1)  # NOTE: seqs run 0, 1, ...: the events on disk
        assert not capture.usage(1).empty
        assert capture.runs().iloc[0].display_status == "running"
        time.sleep(0.05)
    assert seen == sorted(seen) and seen[-1] > seen[0], "the reader saw no progress"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert capture.runs().iloc[0].status == "interrupted"


def test_a_new_file_has_the_packed_tables_and_closing_builds_no_event_index(tmp_path: Path) -> None:
    path = tmp_path / "i.db"
    recorder = SQLRecorder(path)
    recorder.record(EventKind.MATCH, rid="r1", num_tokens=3)
    capture = Capture(path)

    def names(kind: str) -> set[str]:
        with capture.engine.connect() as conn:
            return {row[0] for row in conn.execute(text("SELECT name FROM sqlite_master WHERE type = :t"), {"t": kind})}

    assert {t.name for t in schema.PACKED_TABLES} <= names("table")
    before = names("index")
    assert "ix_events_rid" not in before and "ix_events_node" not in before
    recorder.close()
    # NOTE: a new run's events are chunks, so the row layout's deferred rid / node indexes are never built
    assert names("index") == before
    assert capture.event_counts(1).values.tolist() == [["match", 1]]
    with capture.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM events")).scalar_one() == 0


def test_a_full_buffer_makes_the_caller_wait_for_the_writer(tmp_path: Path) -> None:
    """Buffered events are handed over when the step advances with flush_max_events waiting;
    with 4 x flush_max_events handed over and not yet written, the hand-off waits."""
    most_buffered = most_in_flight = 0
    with SQLRecorder(tmp_path / "b.db", flush_interval_s=60, flush_max_events=100) as recorder:
        for step in range(500):
            recorder.step = step
            for _ in range(10):
                recorder.record(EventKind.LOCK, node_id=1)
            most_buffered = max(most_buffered, len(recorder._items) // ITEM_WIDTH)
            most_in_flight = max(most_in_flight, recorder._items_sent - recorder._items_done)
    assert most_buffered <= 100 + 10, "the buffer outgrew flush_max_events and a step"
    assert 100 <= most_in_flight <= 4 * 100 + 110, "the writer's backlog outgrew its back-pressure cap"
    assert len(Capture(tmp_path / "b.db").events(1, limit=None)) == 5000


def test_the_store_takes_a_sqlalchemy_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'url.db'}"
    with SQLRecorder(url, label="by-url") as recorder:
        recorder.record(EventKind.MATCH, rid="r1", num_tokens=3)
    capture = Capture(url)
    assert capture.runs().iloc[0].label == "by-url"
    assert list(capture.events(1).rid) == ["r1"]


# -- the packed writer (schema version 6) ------------------------------------------------------


def recorded_events(recorder: SQLRecorder) -> list[tuple]:
    """Records a mix of events across many flushes; returns every event as (step, kind, pool,
    rid, node_id, num_tokens, aux, reason, principal, slots as a list or None), in seq order."""
    import torch

    expected: list[tuple] = []
    for step in range(12):
        recorder.step = step
        # NOTE: a string first seen in a later chunk (rid, principal) must still read back
        rid, who = f"req-{step // 3}", None if step % 2 else f"user-{step}"
        recorder.record(
            EventKind.INSERT,
            pool=PoolName.FULL,
            rid=rid,
            node_id=step,
            num_tokens=step + 1,
            slots=torch.arange(step, step + 3, dtype=torch.int64),
            aux=-step,
            principal=who,
        )
        expected.append((step, "insert", "full", rid, step, step + 1, -step, None, who, [step, step + 1, step + 2]))
        recorder.record(EventKind.LOCK, node_id=None if step % 3 else 7)
        expected.append((step, "lock", None, None, None if step % 3 else 7, 0, 0, None, None, None))
        recorder.record(
            EventKind.EVICT, pool=PoolName.SWA, rid=None, num_tokens=2, slots=[], reason=EvictReason.TOMBSTONE
        )
        expected.append((step, "evict", "swa", None, None, 2, 0, "tombstone", None, []))
        rids, counts = (f"b{step}-0", None, f"b{step}-2"), (2, 0, 3)
        recorder.record_batch(
            EventKind.ALLOC,
            pool=PoolName.FULL,
            rids=rids,
            num_tokens=counts,
            slots=np.arange(100 * step, 100 * step + 5, dtype=np.int32),
        )
        starts = (0, 2, 2)
        expected += [
            (step, "alloc", "full", r, None, c, 0, None, None, list(range(100 * step + s, 100 * step + s + c)))
            for r, c, s in zip(rids, counts, starts, strict=True)
        ]
        recorder.record_batch(EventKind.FREE, pool=PoolName.FULL, rids=(), num_tokens=(), slots=np.zeros(0, np.int64))
        recorder.flush()
    return expected


def test_record_and_record_batch_round_trip_exactly_through_many_chunks(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    with SQLRecorder(path, flush_interval_s=60, flush_max_events=4) as recorder:
        expected = recorded_events(recorder)
    capture = Capture(path)
    assert len(capture.packed.chunks(1)) == 12
    frame = capture.events(1, limit=None)
    assert list(frame.seq) == list(range(len(expected)))
    got = []
    for row in frame.itertuples():
        node = None if row.node_id is None or pd.isna(row.node_id) else int(row.node_id)
        rid, pool, reason, principal = (
            None if pd.isna(v) else v for v in (row.rid, row.pool, row.reason, row.principal)
        )
        got.append(
            (
                row.step,
                row.kind,
                pool,
                rid,
                node,
                row.num_tokens,
                row.aux,
                reason,
                principal,
                None if row.slots is None else decode_slots(row.slots),
            )
        )
    assert got == expected
    assert capture.last_event_seq(1) == len(expected) - 1
    counts = dict(capture.event_counts(1).itertuples(index=False))
    assert counts == {"alloc": 36, "evict": 12, "insert": 12, "lock": 12}
    streamed = [r for batch in capture.event_stream(1, ["seq", "rid", "node_id"], batch_rows=7) for r in batch]
    assert streamed == [(i, e[3], e[4]) for i, e in enumerate(expected)]


def test_a_killed_run_keeps_every_committed_chunk(tmp_path: Path) -> None:
    path = tmp_path / "k6.db"
    flushed = kill_writer_after(path, 3000)
    capture = Capture(path)
    chunks = capture.packed.chunks(1)
    assert len(chunks) >= 6 and chunks.num_events.sum() >= flushed
    frame = capture.events(1, limit=None, columns=["seq", "step", "rid", "num_tokens", "slots"])
    assert (frame.seq.to_numpy() == np.arange(len(frame))).all(), "a gap in the event sequence"
    assert (frame.rid == [f"r{s}" for s in frame.step]).all() and (frame.num_tokens == 8).all()
    assert all(decode_slots(s) == list(range(8)) for s in frame.slots)
    assert capture.runs().iloc[0].display_status == ENDED_WITHOUT_CLOSING


def test_a_version_5_file_gets_a_packed_second_run_and_reads_both(tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "v5.db"
    shutil.copy(ROOT / "tests" / "telemetry" / "data" / "v5" / "radix.db", path)
    before = Capture(path).events(1, limit=None)
    assert Capture(path).schema_version == 5 and len(before) > 0
    with SQLRecorder(path, flush_interval_s=60, flush_max_events=4) as recorder:
        expected = recorded_events(recorder)
    capture = Capture(path)
    assert capture.schema_version == schema.SCHEMA_VERSION
    assert capture.packed.chunks(1).empty and len(capture.packed.chunks(2)) == 12
    pd.testing.assert_frame_equal(capture.events(1, limit=None), before)
    assert [None if pd.isna(r) else r for r in capture.events(2, limit=None).rid] == [e[3] for e in expected]
    with capture.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM events WHERE run_id = 2")).scalar_one() == 0


# -- the writer process ------------------------------------------------------------------------


def test_the_writer_process_ends_with_the_capture_and_ignores_ctrl_c(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    recorder = SQLRecorder(path, flush_interval_s=60)
    recorder.wait_ready()
    pid = recorder.writer_pid
    assert os.getpgid(pid) == pid, "the writer runs in a process group of its own"
    os.kill(pid, signal.SIGINT)  # a terminal's Ctrl-C does not reach it; were it sent, it is ignored
    recorder.step = 1
    recorder.record(EventKind.MATCH, rid="r1", num_tokens=3)
    recorder.close()
    assert recorder.failure is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # exited and reaped
    assert list(Capture(path).events(1).rid) == ["r1"]


def test_a_writer_process_that_dies_stops_recording_with_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dead.db"
    recorder = SQLRecorder(path, flush_interval_s=60)
    for step in range(3):
        recorder.step = step
        recorder.record(EventKind.MATCH, rid=f"r{step}", num_tokens=3)
        recorder.flush()
    os.kill(recorder.writer_pid, signal.SIGKILL)
    recorder.step = 3
    recorder.record(EventKind.MATCH, rid="r3", num_tokens=3)
    recorder.flush()
    expected = "capture complete through step 1: the recorder's writer process ended (killed by signal 9)"
    assert recorder.failure == expected
    recorder.step = 4
    recorder.record(EventKind.MATCH, rid="r4", num_tokens=3)  # dropped: recording stopped
    recorder.close()
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err
    capture = Capture(path)
    run = capture.runs().iloc[0]
    assert (run.status, run.error) == ("incomplete", expected)
    assert list(capture.events(1).rid) == ["r0", "r1", "r2"]


def test_a_run_its_process_never_closed_is_crashed_not_finished(tmp_path: Path) -> None:
    """The exit-time close is for a process an error ended before its owner closed the run (kvscope attach
    dying of a RecursionError was left 'finished'): it marks the run 'crashed'."""
    path = tmp_path / "left.db"
    code = (
        "import sys; from kvscope.telemetry import EventKind; from kvscope.telemetry.recorder import SQLRecorder; "
        f"recorder = SQLRecorder({str(path)!r}, level='full'); "
        "recorder.record(EventKind.MATCH, rid='r1', num_tokens=3); sys.exit(0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    capture = Capture(path)
    try:
        run = capture.runs().iloc[0]
        assert (run.status, run.error) == ("crashed", "the process exited without closing its run")
        assert len(capture.events(int(run.id))) == 1  # what it recorded was still handed over and written
    finally:
        capture.close()
