"""A capture a reader (the dashboard) still held open when its writer closed keeps its -wal and
-shm; the reader, the last to close, folds them back once the runs are closed: one file. Not while a
run still records."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvscope.telemetry import PoolTerms, UsageSample
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder


def usage(step: int) -> UsageSample:
    return UsageSample(step, PoolTerms(100, 60, 30, 10), None, 4, 2, 2, step, 10 * step, 5 * step, step, step, 0, 0)


def sidecars(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_the_last_reader_to_close_a_closed_capture_leaves_one_file(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    recorder = SQLRecorder(path, level="full", label="held")
    recorder.step = 1
    recorder.usage(usage(1))
    recorder.flush()
    reader = Capture(path)
    assert len(reader.runs()) == 1
    assert reader.close_and_settle() is False  # NOTE: the run still records: left as it is
    assert "c.db-wal" in sidecars(path)
    reader = Capture(path)
    assert len(reader.runs()) == 1
    recorder.close()
    assert sidecars(path) == ["c.db-shm", "c.db-wal"]  # the reader holds the file: the writer could not fold it
    assert reader.close_and_settle() is True
    assert sidecars(path) == []
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT status FROM runs").fetchone()[0] == "finished"
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_a_capture_its_writer_had_closed_is_not_converted(tmp_path: Path) -> None:
    """A WAL-mode capture with no log beside it when it was opened (a copy of a closed file, a test's
    data file) is not the dashboard's to convert: its header stays WAL."""
    path = tmp_path / "c.db"
    with SQLRecorder(path, level="full", label="closed") as recorder:
        recorder.step = 1
        recorder.usage(usage(1))
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
    with sqlite3.connect(path) as conn:  # NOTE: the last close folds the log away; the header stays WAL
        conn.execute("SELECT 1")
    before = path.read_bytes()
    assert sidecars(path) == [] and before[18:20] == b"\x02\x02"
    reader = Capture(path)
    assert len(reader.runs()) == 1
    assert reader.close_and_settle() is False
    assert path.read_bytes()[18:20] == b"\x02\x02"
