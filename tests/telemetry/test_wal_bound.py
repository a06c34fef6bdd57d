"""A reader that holds one snapshot for a while (a dashboard session mid-read) stops SQLite from
restarting the writer's -wal log, so the log grows with what the run writes meanwhile. Once the reader
lets go, the log restarts, and the writer cuts it back to WAL_LIMIT_BYTES: a week-long run under a
size bound does not keep a log the size of its longest read beside the file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np

from kvscope.telemetry import EventKind, PoolName
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.writer import WAL_LIMIT_BYTES


def _write(recorder: SQLRecorder, steps: range) -> None:
    for step in steps:
        recorder.step = step
        slots = np.random.default_rng(step).integers(1, 1 << 40, 16384)  # NOTE: incompressible
        recorder.record_batch(EventKind.ALLOC, pool=PoolName.FULL, rids=[f"r{step}"], num_tokens=[16384], slots=slots)
        recorder.flush()


def _wal_bytes(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_the_log_a_long_read_grew_is_cut_back_once_the_reader_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    recorder = SQLRecorder(path, level="full", label="wal")
    try:
        _write(recorder, range(10))
        reader = sqlite3.connect(path)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM runs").fetchone()  # NOTE: a snapshot held from here
        _write(recorder, range(10, 1000))
        grown = _wal_bytes(path)
        assert grown > 1.2 * WAL_LIMIT_BYTES, f"the log grew to {grown:,} bytes only: the test shows nothing"
        reader.rollback()
        reader.close()
        _write(recorder, range(1000, 1100))  # NOTE: checkpoints now reach the log's end; the log restarts
        assert _wal_bytes(path) <= WAL_LIMIT_BYTES, f"the log stays at {_wal_bytes(path):,} bytes"
    finally:
        recorder.close()
