"""A large capture's page check (SQLite's quick_check before a verdict) runs once per version of the
file: a reader of the same unchanged file later skips it; a file changed since, or one whose check
failed, is checked again; a cache that cannot be written costs only the check."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.debug.report import stored_report, verdict
from kvscope.telemetry import page_checks, store
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.store import CaptureError

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "shared-prefix.db"


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """Every file counts as large; the names quick_check ran on, in order; a cache of this test's own."""
    monkeypatch.setattr(store, "QUICK_CHECK_MAX_BYTES", 0)
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    ran: list[str] = []
    real = store.quick_check

    def counted(conn: object, name: str) -> None:
        ran.append(name)
        real(conn, name)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "quick_check", counted)
    yield ran


def verdict_of(path: Path) -> str:
    capture = Capture(path)
    try:
        report = stored_report(capture, 1)
        assert report is not None, "the sample stores its leak report"
        return verdict(report).verdict
    finally:
        capture.engine.dispose()


def test_an_unchanged_file_is_checked_once(checks: list[str], tmp_path: Path) -> None:
    path = tmp_path / "capture.db"
    shutil.copy(SAMPLE, path)
    assert [verdict_of(path) for _ in range(3)] == ["clean"] * 3
    assert len(checks) == 1
    assert page_checks.cache_path().exists()


def test_a_file_changed_since_is_checked_again_and_its_damage_seen(checks: list[str], tmp_path: Path) -> None:
    path = tmp_path / "capture.db"
    shutil.copy(SAMPLE, path)
    verdict_of(path)
    with sqlite3.connect(path) as conn:  # NOTE: a page of the events: no read of a stored verdict touches it
        pages = [n for (n,) in conn.execute("SELECT pageno FROM dbstat WHERE name = 'event_columns' ORDER BY pageno")]
        page = int(conn.execute("PRAGMA page_size").fetchone()[0])
    conn.close()
    with path.open("r+b") as file:  # NOTE: garbage over it: only SQLite's check names it
        file.seek((pages[len(pages) // 2] - 1) * page)
        file.write(b"\xa5" * page)
    with pytest.raises(CaptureError, match="damaged capture"):
        verdict_of(path)
    assert len(checks) == 2
    with pytest.raises(CaptureError, match="damaged capture"):  # NOTE: a failed check is never remembered
        verdict_of(path)
    assert len(checks) == 3


def test_a_touched_file_is_checked_again(checks: list[str], tmp_path: Path) -> None:
    path = tmp_path / "capture.db"
    shutil.copy(SAMPLE, path)
    verdict_of(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    verdict_of(path)
    assert len(checks) == 2


def test_a_cache_that_cannot_be_written_costs_only_the_check(
    checks: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(blocked))
    path = tmp_path / "capture.db"
    shutil.copy(SAMPLE, path)
    verdict_of(path)
    verdict_of(path)
    assert len(checks) == 2
