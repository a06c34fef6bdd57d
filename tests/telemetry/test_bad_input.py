"""Bad captures: one clear line naming the file and the problem, a non-zero exit from the
CLI, no traceback, and nothing written to the file."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.store import CaptureError


def make_good(path: Path) -> Path:
    SQLRecorder(path, label="good").close()
    return path


def make_text(path: Path) -> Path:
    path.write_text("this is not a database\n" * 20)
    return path


def make_truncated(path: Path) -> Path:
    good = make_good(path.with_name("full.db"))
    path.write_bytes(good.read_bytes()[:6000])
    return path


def execute(path: Path, sql: str) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(sql)
    conn.close()


def make_foreign(path: Path) -> Path:
    execute(path, "CREATE TABLE customers (id INTEGER)")
    return path


def make_newer(path: Path) -> Path:
    make_good(path)
    execute(path, "UPDATE kvscope_meta SET value = '99' WHERE key = 'schema_version'")
    return path


def make_empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


CASES = {
    "missing": (lambda p: p, "no such file"),
    "text": (make_text, "not a kvscope capture (not a SQLite database)"),
    "truncated": (make_truncated, "damaged capture (truncated: 6000 bytes"),
    "foreign": (make_foreign, "not a kvscope capture (no kvscope_meta table)"),
    "newer": (make_newer, "newer kvscope (schema version 99"),
    "empty": (make_empty, "empty capture (no run recorded in it yet)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_capture_gives_one_clear_line_and_changes_nothing(tmp_path: Path, case: str) -> None:
    make, message = CASES[case]
    path = make(tmp_path / f"{case}.db")
    before = path.read_bytes() if path.exists() else None
    with pytest.raises(CaptureError, match=re.escape(message)) as err:
        Capture(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "runs", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and message.split("(")[0].strip() in out.stderr
    assert "Traceback" not in out.stderr
    assert (path.read_bytes() if path.exists() else None) == before
    wal = Path(f"{path}-wal")  # SQLite's read-only WAL readers may leave an empty companion file
    assert not wal.exists() or wal.stat().st_size == 0


def test_the_recorder_refuses_to_write_into_a_foreign_or_newer_file(tmp_path: Path) -> None:
    for make in (make_text, make_foreign, make_newer):
        path = make(tmp_path / f"{make.__name__}.db")
        before = path.read_bytes()
        with pytest.raises(CaptureError):
            SQLRecorder(path)
        assert path.read_bytes() == before


def test_many_runs_share_one_capture(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    for label in ("a", "b", "c"):
        SQLRecorder(path, label=label).close()
    runs = Capture(path).runs()
    assert list(runs.label) == ["a", "b", "c"] and list(runs.id) == [1, 2, 3]
