"""The run's heartbeat beats while the recording process lives, with or without events, and
stops when it dies: an idle run (a `kvscope serve` with no traffic) reads as running after
more than the readers' staleness threshold, a killed one as "ended without closing"."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvscope.telemetry import queries
from kvscope.telemetry.queries import ENDED_WITHOUT_CLOSING, Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.writer import HEARTBEAT_INTERVAL_S

ROOT = Path(__file__).resolve().parents[2]
BEAT_S = 0.1
STALE_S = 1.0  # the readers' threshold in these tests: 10 beats, as 30 s is 6 of the default 5 s

IDLE_RECORDER = textwrap.dedent(f"""
    import sys, time
    from kvscope.telemetry.recorder import SQLRecorder
    recorder = SQLRecorder(sys.argv[1], level="full", heartbeat_interval_s={BEAT_S})
    print("ready", flush=True)
    time.sleep(600)
""")


def heartbeat_at(path: Path) -> float:
    with sqlite3.connect(path) as db:
        return float(db.execute("select heartbeat_at from runs").fetchone()[0])


def test_the_default_beat_is_well_inside_the_readers_threshold() -> None:
    assert queries.STALE_HEARTBEAT_S >= 3 * HEARTBEAT_INTERVAL_S


def test_an_idle_run_reads_as_running_past_the_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queries, "STALE_HEARTBEAT_S", STALE_S)
    path = tmp_path / "idle.db"
    with SQLRecorder(path, heartbeat_interval_s=BEAT_S):
        started = heartbeat_at(path)
        time.sleep(3 * STALE_S)  # no event, no flush
        assert heartbeat_at(path) > started + 2 * STALE_S
        assert Capture(path).runs().iloc[0].display_status == "running"


def test_a_killed_idle_recorder_stops_beating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queries, "STALE_HEARTBEAT_S", STALE_S)
    path = tmp_path / "killed.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", IDLE_RECORDER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(2 * STALE_S)
        assert Capture(path).runs().iloc[0].display_status == "running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    time.sleep(10 * BEAT_S)  # the writer sees its channel close and exits
    last = heartbeat_at(path)
    time.sleep(STALE_S + 10 * BEAT_S)
    assert heartbeat_at(path) == last, "the heartbeat went on after the recording process died"
    assert time.time() - last > STALE_S
    assert Capture(path).runs().iloc[0].display_status == ENDED_WITHOUT_CLOSING
