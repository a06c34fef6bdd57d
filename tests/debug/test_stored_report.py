"""A leak report stored in the capture is used only while it still describes the run (the
run's last event, this version, an undamaged body); a capture from before the reports table
reads, and gains it."""

from __future__ import annotations

import dataclasses
import shutil
import sqlite3
from pathlib import Path

import pytest

from kvscope.debug import report as leak_report
from kvscope.debug.report import LeakReport, build_report, save_report, stored_report
from kvscope.telemetry.queries import Capture
from tests.stored_report_helpers import ROOT, record, same


def test_a_stored_report_that_no_longer_matches_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.db"
    record(path, "--no-report")
    report = build_report(path)

    def stored() -> LeakReport | None:
        capture = Capture(path)
        try:
            return stored_report(capture, report.run_id)
        finally:
            capture.close()

    save_report(path, dataclasses.replace(report, through_seq=report.through_seq - 1))  # misses the last event
    assert stored() is None
    save_report(path, report)
    assert stored() is not None
    monkeypatch.setattr(leak_report, "PRODUCER", "kvscope 0.0.1 / leak report 0")  # another version built it
    assert stored() is None
    monkeypatch.undo()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE reports SET body = '{not json'")
    assert stored() is None  # a damaged body: rebuilt, not a traceback


def test_a_capture_from_before_the_reports_table_reads_and_gains_it(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    shutil.copy(ROOT / "sample_runs" / "leaky.db", path)
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE IF EXISTS reports")
    capture = Capture(path)
    try:
        assert stored_report(capture, 1) is None and not capture.runs().empty
    finally:
        capture.close()
    report = build_report(path)
    save_report(path, report)
    capture = Capture(path)
    try:
        assert same(stored_report(capture, 1) or LeakReport("", 0, "", ""), report)
    finally:
        capture.close()
