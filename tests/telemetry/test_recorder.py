"""The SQL recorder and the capture store: round trips, levels, crash and concurrency."""

from __future__ import annotations

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
from kvscope.telemetry.queries import ENDED_WITHOUT_CLOSING, Capture
from kvscope.telemetry.recorder import SQLRecorder, decode_slots

ROOT = Path(__file__).resolve().parents[2]


def test_every_event_kind_round_trips_with_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    with SQLRecorder(path, level="full", label="kinds", config={"cache": "radix"}) as recorder:
        for i, kind in enumerate(EventKind):
            recorder.step = i
            recorder.record(kind, pool=PoolName.SWA if i % 2 else PoolName.FULL, rid=f"r{i}", node_id=i * 10,
                            num_tokens=i + 1, slots=np.array([i, i + 1, 70000]), reason=EvictReason.TOMBSTONE,
                            aux=-i, principal=f"u{i}" if i % 3 else None)
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
    assert frame.full_available.min() == 10 + 0 or frame.full_available.max() == 54


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


def test_sigkill_leaves_everything_up_to_the_last_flush(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    proc = subprocess.Popen([sys.executable, "-m", "tests.telemetry.writer_proc", str(path), "100000"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    flushed = 0
    for line in proc.stdout:
        flushed = int(line.split()[1])
        if flushed >= 5000:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    capture = Capture(path)
    seqs = capture.events(1, limit=10_000_000).seq.to_numpy()
    assert len(seqs) >= flushed, "events flushed before the kill are missing"
    assert (seqs == np.arange(len(seqs))).all(), "a gap in the event sequence"
    run = capture.runs().iloc[0]
    assert run.status == "running" and run.display_status == ENDED_WITHOUT_CLOSING


def test_reader_reads_while_a_writer_process_writes_and_sigterm_finishes(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    proc = subprocess.Popen([sys.executable, "-m", "tests.telemetry.writer_proc", str(path), "100000"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    capture = Capture(path)
    seen = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        with capture.engine.connect() as conn:
            seen.append(conn.execute(text("SELECT count(*) FROM events")).scalar_one())
        assert not capture.usage(1).empty
        assert capture.runs().iloc[0].display_status == "running"
        time.sleep(0.05)
    assert seen == sorted(seen) and seen[-1] > seen[0], "the reader saw no progress"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert capture.runs().iloc[0].status == "interrupted"


def test_request_and_node_indexes_exist_once_a_run_closes(tmp_path: Path) -> None:
    path = tmp_path / "i.db"
    recorder = SQLRecorder(path)
    capture = Capture(path)
    names = {row[0] for row in capture.engine.connect().execute(text("SELECT name FROM sqlite_master "
                                                                     "WHERE type = 'index'"))}
    assert "ix_events_step" in names and "ix_events_rid" not in names
    recorder.close()
    names = {row[0] for row in capture.engine.connect().execute(text("SELECT name FROM sqlite_master "
                                                                     "WHERE type = 'index'"))}
    assert {"ix_events_rid", "ix_events_node"} <= names


def test_a_full_buffer_makes_the_caller_wait_for_the_writer(tmp_path: Path) -> None:
    with SQLRecorder(tmp_path / "b.db", flush_interval_s=60, flush_max_events=100) as recorder:
        for _ in range(1000):
            recorder.record(EventKind.LOCK, node_id=1)
            assert len(recorder._events) <= 400, "the buffer outgrew its back-pressure cap"
    assert len(Capture(tmp_path / "b.db").events(1, limit=5000)) == 1000


def test_the_store_takes_a_sqlalchemy_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'url.db'}"
    with SQLRecorder(url, label="by-url") as recorder:
        recorder.record(EventKind.MATCH, rid="r1", num_tokens=3)
    capture = Capture(url)
    assert capture.runs().iloc[0].label == "by-url"
    assert list(capture.events(1).rid) == ["r1"]
