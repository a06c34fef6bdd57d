"""scripts/compare_captures.py, the behaviour-identity check of a restructuring, on real captures
written by the SQL recorder (packed events, the current schema) and run as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from kvscope.telemetry import EventKind, EvictReason, PoolName
from kvscope.telemetry.recorder import SQLRecorder

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_captures.py"
NUM_EVENTS = 40


def write_capture(path: Path, changed_seq: int | None = None) -> None:
    """A small run; the event at `changed_seq` (if any) evicts one token more than in the others."""
    with SQLRecorder(path, level="full", label="compare", config={"cache": "radix"}) as recorder:
        for seq in range(NUM_EVENTS):
            recorder.step = seq // 4
            num_tokens = seq % 7 + 1 + (seq == changed_seq)
            recorder.record(
                EventKind.EVICT,
                pool=PoolName.FULL,
                rid=f"r{seq % 3}",
                node_id=seq,
                num_tokens=num_tokens,
                slots=np.arange(seq, seq + num_tokens),
                reason=EvictReason.CAPACITY,
                aux=seq % 2,
                principal="alice" if seq % 2 else None,
            )


def compare(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True, check=False, cwd=ROOT
    )


def events_line(result: subprocess.CompletedProcess[str]) -> str:
    return next(line for line in result.stdout.splitlines() if line.startswith("events:"))


def test_two_runs_of_the_same_packed_events_compare_equal(tmp_path: Path) -> None:
    write_capture(tmp_path / "a.db")
    write_capture(tmp_path / "b.db")  # NOTE: other t_mono, run clock and pid: none of them compared
    result = compare(tmp_path / "a.db", tmp_path / "b.db")
    assert result.returncode == 0, result.stdout + result.stderr
    assert events_line(result) == f"events: equal ({NUM_EVENTS} rows)"


def test_one_packed_event_that_differs_fails_the_comparison(tmp_path: Path) -> None:
    write_capture(tmp_path / "a.db")
    write_capture(tmp_path / "b.db", changed_seq=17)
    result = compare(tmp_path / "a.db", tmp_path / "b.db")
    assert result.returncode == 1, result.stdout + result.stderr
    line = events_line(result)
    assert line.startswith(f"events: 1 of {NUM_EVENTS} rows differ; first: A=(run_id=1, seq=17,"), line
    assert "num_tokens=4" in line and "num_tokens=5" in line, line
