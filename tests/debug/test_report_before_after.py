"""The leak report of random recordings is the one the replay gave before it was made faster
(commit abcdbd6, ~10 µs of CPU per event; see benchmarks/RESULTS.md, bench_dashboard's replay
row): leaks, culprits, double frees, stuck copies, bad reads, onset and every other field.

data/reports_before.json holds those reports, made by that commit's code from the recordings of
random_recording.py (`PYTHONPATH=<that tree> python tests/debug/random_recording.py OUT.json`); each
seed records the same events every time, so a recording made now must give the same report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.debug.report import build_report
from tests.debug.random_recording import REPORT_SEEDS, record_random, report_fields

BEFORE = json.loads((Path(__file__).parent / "data" / "reports_before.json").read_text())


def test_the_stored_reports_cover_every_seed_and_every_kind_of_defect() -> None:
    assert sorted(map(int, BEFORE)) == list(REPORT_SEEDS)
    kinds = {leak["kind"] for report in BEFORE.values() for leak in report["leaks"]}
    assert kinds == {"orphaned", "double-free", "lock-never-released", "copy-never-acknowledged", "use-after-free"}
    assert any(leak["consequence_of"] for report in BEFORE.values() for leak in report["leaks"])
    assert any(not report["leaks"] for report in BEFORE.values())  # a clean one too


@pytest.mark.parametrize("seed", REPORT_SEEDS)
def test_a_random_recording_gives_the_report_it_gave_before(tmp_path: Path, seed: int) -> None:
    path = tmp_path / f"random-{seed}.db"
    record_random(path, seed)
    got, before = report_fields(build_report(path)), BEFORE[str(seed)]
    assert got.keys() == before.keys()
    for name, value in before.items():
        assert got[name] == value, name
