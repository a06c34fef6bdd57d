"""A report resumed on a growing capture (the dashboard's live Leaks page) equals a fresh one
at every point, whether the capture was cut between steps or in the middle of one."""

from __future__ import annotations

import dataclasses
import shutil
import sqlite3
from pathlib import Path

import pytest

from kvscope.debug.replay import Replay
from kvscope.debug.report import ReportState, build_report
from tests.telemetry.oracle_reads import unpack_to_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sample", ["leaky", "hybrid-swa"])
def test_a_resumed_report_equals_a_fresh_one_as_the_capture_grows(tmp_path: Path, sample: str) -> None:
    full = tmp_path / "full.db"
    shutil.copy(ROOT / "sample_runs" / f"{sample}.db", full)
    unpack_to_rows(full)  # NOTE: the capture grows by `events` rows, copied over in SQL
    growing = tmp_path / "growing.db"
    shutil.copy(full, growing)
    with sqlite3.connect(growing) as conn:
        last = conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        conn.execute("DELETE FROM events WHERE seq > 0")
    cuts = [1, 2, last // 7, last // 3, last // 3 + 1, last // 2, last - 1, last]  # mid-step cuts too
    state = ReportState(Replay(1))
    shown = 0
    for cut in cuts:
        with sqlite3.connect(growing) as conn:
            conn.execute("ATTACH DATABASE ? AS src", (str(full),))
            conn.execute("INSERT INTO events SELECT * FROM src.events WHERE seq > ? AND seq <= ?", (shown, cut))
        shown = cut
        resumed = build_report(growing, 1, state=state)
        fresh = build_report(growing, 1)
        assert dataclasses.asdict(resumed) == dataclasses.asdict(fresh), cut
        assert resumed.through_seq == cut
    assert build_report(growing, 1).leaks == build_report(full, 1).leaks
