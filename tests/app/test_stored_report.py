"""The leak report `kvscope run` stores in the capture when a run closes: equal to a fresh
replay; none with --no-report or at level summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.debug.report import build_report, stored_report
from kvscope.telemetry.queries import Capture
from tests.stored_report_helpers import record, same


@pytest.mark.parametrize(
    "inject", [[], ["--inject", "leak-tail:0.3", "--inject", "lock-leak:0.2"]], ids=["clean", "leaky"]
)
def test_a_full_run_stores_the_report_a_replay_gives(tmp_path: Path, inject: list[str]) -> None:
    path = tmp_path / "run.db"
    done = record(path, *inject)
    fresh = build_report(path)
    assert "(stored in the capture)" in done.stdout
    assert ("clean" in done.stdout) == fresh.clean
    capture = Capture(path)
    try:
        stored = stored_report(capture, fresh.run_id)
    finally:
        capture.close()
    assert stored is not None and stored.stored_at is not None
    assert same(stored, fresh) and stored.through_seq == fresh.through_seq > 0
    assert bool(inject) == bool(stored.leaks)


def test_no_report_and_summary_runs_store_none(tmp_path: Path) -> None:
    for name, extra in (("off.db", ["--no-report"]), ("summary.db", ["--level", "summary"])):
        record(tmp_path / name, *extra)
        capture = Capture(tmp_path / name)
        try:
            assert stored_report(capture, 1) is None
        finally:
            capture.close()
