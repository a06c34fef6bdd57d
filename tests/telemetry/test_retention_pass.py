"""The writer's retention pass (telemetry/retention.py) on a real capture file: it drops the oldest
whole chunks past the window or over the size bound, never the newest, moves the run's
event_retention row with them; a gated run's window drops only what its ledger checkpoint covers,
and a size bound waits for it up to 95% of the bound. Readers read what is kept as an undamaged run."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from kvscope.telemetry import (
    Capture,
    EventKind,
    LeakCheck,
    PoolName,
    PoolTerms,
    Retention,
    SQLRecorder,
    UsageSample,
    open_writer,
    parse_duration_s,
    parse_size_bytes,
    schema,
)


def record(path: Path | str, retention: Retention, *, steps: int = 60, sleep_s: float = 0.0) -> int:
    recorder = SQLRecorder(path, retention=retention)
    for step in range(steps):
        recorder.step = step
        recorder.usage(UsageSample(step, PoolTerms(4096, 1024, 0, 0), None, 0, 0, 1, 0, 100, 64, 1, 1, 0, 0))
        if step == CHECK_STEP:
            recorder.leak_check(LeakCheck(step, "full", 4096, 4096, 0, 0, 0, 0))
        for i in range(40):
            recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step}", slots=np.arange(i * 32, i * 32 + 32))
        recorder.flush()
        if sleep_s:
            time.sleep(sleep_s)
    recorder.close()
    return recorder.run_id


CHECK_STEP = 13


def retained(path: Path) -> tuple[int, int, int]:
    """first_seq, chunks kept, first kept chunk's first_seq."""
    conn = sqlite3.connect(path)
    try:
        (first_seq,) = conn.execute("SELECT first_seq FROM event_retention").fetchone()
        num_chunks, first_chunk_seq = conn.execute("SELECT count(*), min(first_seq) FROM event_chunks").fetchone()
    finally:
        conn.close()
    return int(first_seq), int(num_chunks), int(first_chunk_seq)


def test_a_size_bound_keeps_the_file_under_it_and_the_run_readable(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.db"
    bound = 400_000
    record(path, Retention(max_bytes=bound))
    assert "cannot keep its size bound" not in capfd.readouterr().err
    first_seq, num_chunks, first_chunk_seq = retained(path)
    assert path.stat().st_size <= bound and first_seq > 0 and num_chunks >= 1 and first_chunk_seq == first_seq
    capture = Capture(path)
    try:
        events = capture.events(1, limit=None)
        assert int(events.seq.min()) == first_seq and int(events.seq.max()) == 60 * 40 - 1
    finally:
        capture.close()
    conn = sqlite3.connect(path)
    try:
        ((first_step,),) = conn.execute("SELECT first_step FROM event_retention").fetchall()
        steps = [step for (step,) in conn.execute("SELECT step FROM usage ORDER BY step")]
    finally:
        conn.close()
    # NOTE: past the kept events one usage row in ten steps stays, and the one at the leak check
    assert first_step > CHECK_STEP and steps == sorted(
        {s for s in range(first_step) if s % 10 == 0} | {CHECK_STEP} | set(range(first_step, 60))
    )


def kept_strings(target: Path | str, run_id: int) -> tuple[set[str], set[str]]:
    """The run's event_strings rows, and the strings its kept events use."""
    capture = Capture(target)
    try:
        events = capture.events(run_id, limit=None)
        s = schema.event_strings.c
        with capture.engine.connect() as conn:
            rows = {str(t) for (t,) in conn.execute(select(s.text).where(s.run_id == run_id))}
    finally:
        capture.close()
    return rows, {str(v) for name in ("kind", "pool", "rid") for v in events[name].dropna()}


def test_the_strings_only_dropped_events_used_go_with_them(tmp_path: Path) -> None:
    """Every event its own long request id (as a server's are): the strings stay those of the kept events,
    the file under its bound; a string dropped and used again is written again and reads back."""
    path, bound = tmp_path / "c.db", 400_000
    recorder = SQLRecorder(path, retention=Retention(max_bytes=bound))
    for step in range(60):
        recorder.step = step
        for i in range(40):
            rid = "again" if i == 0 and step in (0, 59) else f"request-{step:06d}-{i:04d}-{'x' * 32}"
            recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=rid, slots=np.arange(i * 32, i * 32 + 32))
        recorder.flush()
    recorder.close()
    rows, used = kept_strings(path, recorder.run_id)
    assert rows == used and "again" in rows and not any(r.startswith("request-000000") for r in rows)
    assert path.stat().st_size <= bound
    capture = Capture(path)
    try:
        last = capture.events(recorder.run_id, limit=None).iloc[-40]
        assert (int(last.step), last.rid) == (59, "again")
    finally:
        capture.close()


def test_a_window_drops_what_is_older_and_keeps_the_newest_chunk(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    record(path, Retention(keep_events_s=0.2), steps=12, sleep_s=0.05)
    first_seq, num_chunks, _ = retained(path)
    assert first_seq > 0 and 1 <= num_chunks < 12


def test_a_gated_run_drops_nothing_its_checkpoint_does_not_cover(tmp_path: Path) -> None:
    gated, ungated = tmp_path / "gated.db", tmp_path / "ungated.db"
    record(gated, Retention(keep_events_s=0.01, gated=True), steps=12, sleep_s=0.05)
    record(ungated, Retention(keep_events_s=0.01, gated=False), steps=12, sleep_s=0.05)
    assert retained(gated)[0] == 0 and retained(ungated)[0] > 0


def test_a_size_bound_passes_the_checkpoint_only_near_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    record(path, Retention(max_bytes=400_000, gated=True), steps=150)
    assert path.stat().st_size <= 400_000 and retained(path)[0] > 0


def test_a_gated_run_without_a_checkpoint_keeps_its_bound_under_large_batches(tmp_path: Path) -> None:
    """No checkpointer: the gate holds the drops until the bound must win. Each batch is about a tenth of
    the bound, so the gate gives way while the next batch still fits (at 95% of the bound, one landed past it)."""
    path = tmp_path / "c.db"
    bound = 600_000
    recorder = SQLRecorder(path, retention=Retention(max_bytes=bound, gated=True))
    rng = np.random.default_rng(3)
    for step in range(60):
        recorder.step = step
        for i in range(30):
            recorder.record(
                EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step}-{i}", slots=rng.integers(0, 1 << 30, 400)
            )
        recorder.flush()
    recorder.close()
    assert retained(path)[0] > 0 and path.stat().st_size <= bound


def test_batches_of_several_chunks_fit_under_the_bound(tmp_path: Path) -> None:
    """A slow writer's batch holds up to flush_max_events events, several chunks of 65,536 in one
    transaction: the pass keeps room for the largest recent one, so a file bounded at about four
    batches stays under its bound (at 80% to 60% alone, a batch landed past it)."""
    path = tmp_path / "c.db"
    slots = np.arange(8)
    recorder = SQLRecorder(path, retention=Retention(max_bytes=6 << 20), flush_interval_s=3600.0)
    for step in range(12):
        recorder.step = step
        for i in range(70_000):
            recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r", node_id=i, slots=slots + i)
        recorder.flush()
    recorder.close()
    assert rows_of(path, "SELECT max(chunk) FROM event_chunks") == [(2 * 12 - 1,)]  # NOTE: two chunks a batch
    assert retained(path)[0] > 0 and path.stat().st_size <= 6 << 20


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("6h", 21600), ("7d", 604800), ("1.5", 1.5)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("20GiB", 20 * 2**30), ("20G", 20 * 2**30), ("512Mi", 512 * 2**20), ("500MB", 500 * 10**6), ("4096B", 4096)],
)
def test_sizes(text: str, num_bytes: int) -> None:
    assert parse_size_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["", "0", "-1h", "6x", "inf", "nan"])
def test_bad_durations_and_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration_s(text)
    with pytest.raises(ValueError):
        parse_size_bytes(text)


def test_a_pass_that_cannot_drop_says_so_once_and_loses_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.db"
    open_writer(path).dispose()
    conn = sqlite3.connect(path)
    with conn:  # NOTE: a database that refuses the deletes (as a full disk or a lost server would)
        conn.execute("CREATE TRIGGER keep BEFORE DELETE ON event_chunks BEGIN SELECT RAISE(ABORT, 'kept'); END")
    conn.close()
    record(path, Retention(keep_events_s=0.01), steps=12, sleep_s=0.05)
    lines = [line for line in capfd.readouterr().err.splitlines() if "retention" in line]
    assert lines == ["kvscope recorder: retention could not drop events: kept"]
    assert retained(path)[0] == 0 and rows_of(path, "SELECT count(*) FROM usage") == [(12,)]


def test_a_bound_smaller_than_what_is_kept_for_life_is_said_and_nothing_kept_for_life_goes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The capture's tables alone take more than 64 KiB: the bound cannot be kept. The writer says so
    once on stderr, drops every event but the newest chunk and no leak check; `kvscope runs` says it
    too, as text and as JSON."""
    path = tmp_path / "c.db"
    bound = 64 * 1024
    record(path, Retention(max_bytes=bound), steps=30)
    lines = [line for line in capfd.readouterr().err.splitlines() if "bound" in line]
    assert len(lines) == 1 and lines[0].startswith("kvscope recorder: run 1 cannot keep its size bound: the capture")
    assert "over its bound of 64.0 KiB" in lines[0] and "kept for life" in lines[0]
    assert retained(path)[1] == 1 and rows_of(path, "SELECT step FROM leak_checks") == [(CHECK_STEP,)]
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "runs", str(path)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "WARNING: the size bound is not kept: the capture holds" in out, out
    listed = subprocess.run(
        [sys.executable, "-m", "kvscope", "runs", str(path), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    over = json.loads(listed)["runs"][0]["retention"]["over_bound"]
    assert over["used_bytes"] > bound and bound < over["kept_for_life_bytes"] <= over["used_bytes"]


def rows_of(path: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("text", ["4096", "20", "20 apples", "1.5X"])
def test_a_size_needs_its_unit(text: str) -> None:
    """--max-size and KVSCOPE_MAX_SIZE read one text alike: a bare number (GiB on the command line's
    memory sizes, bytes to some) is refused rather than read one way in one place."""
    with pytest.raises(ValueError, match="with its unit"):
        parse_size_bytes(text)
