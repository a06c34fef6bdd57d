"""What many sessions of one dashboard cost the capture they watch, counted in SQL statements and
connections (every statement SQLite runs for this process, through SQLAlchemy or the driver's own
cursor): sessions at one read stamp share one set of reads and one usage chart; a live refresh opens no
connection."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import event
from sqlalchemy.pool import Pool
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import charts, data
from kvscope.telemetry import EventKind, LeakCheck, PoolName, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard.conftest import ROOT

NUM_SESSIONS = 10


@dataclass
class SqlCount:
    connections: int = 0
    statements: list[str] = field(default_factory=list)
    counting: bool = True

    def add(self, statement: str) -> None:
        if self.counting:
            self.statements.append(statement)

    def reads(self) -> list[str]:
        """The statements that read a table (not BEGIN, ROLLBACK, PRAGMA)."""
        return [s for s in self.statements if s.lstrip().upper().startswith(("SELECT", "WITH"))]


@contextmanager
def counted_sql() -> Iterator[SqlCount]:
    """Every connection this process opens and every statement it runs inside."""
    counts = SqlCount()

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        counts.connections += 1

    def on_checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        dbapi_connection.set_trace_callback(counts.add)

    event.listen(Pool, "connect", on_connect)
    event.listen(Pool, "checkout", on_checkout)
    try:
        yield counts
    finally:
        counts.counting = False
        event.remove(Pool, "checkout", on_checkout)
        event.remove(Pool, "connect", on_connect)


def _sample(step: int) -> UsageSample:
    return UsageSample(step, PoolTerms(100, 60, 30, 10), None, 4, 2, 2, step, 10 * step, 5 * step, step, step, 0, 0)


def _write_steps(recorder: SQLRecorder, steps: range) -> None:
    for step in steps:
        recorder.step = step
        recorder.record_batch(
            EventKind.ALLOC,
            pool=PoolName.FULL,
            rids=[f"r{step}"],
            num_tokens=[2],
            slots=np.array([2 * step + 1, 2 * step + 2]),
        )
        recorder.usage(_sample(step))
        recorder.leak_check(LeakCheck(step, "full", 100, 60, 30, 10, 0, 0, False))
    recorder.flush()


@pytest.fixture
def live_capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SQLRecorder]:
    """A running level-full run (no heartbeat of its own during the test: its stamp moves only when
    the test writes), opened by the app."""
    recorder = SQLRecorder(tmp_path / "live.db", level="full", label="shared", heartbeat_interval_s=3600)
    try:
        _write_steps(recorder, range(3))
        monkeypatch.setenv("KVSCOPE_DB", str(tmp_path / "live.db"))
        monkeypatch.chdir(ROOT)
        yield recorder
    finally:
        recorder.close()
        time.sleep(data.LIVE_TTL_S + 0.1)  # NOTE: the next test's run list is read afresh


def _overview() -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    assert not at.exception, at.exception
    assert "running" in at.caption[0].value
    return at


def test_sessions_at_one_stamp_share_one_set_of_reads(live_capture: SQLRecorder) -> None:
    with counted_sql() as first:
        _overview()
    with counted_sql() as others:
        for _ in range(NUM_SESSIONS - 1):
            _overview()
    assert first.reads(), "the first session read nothing: the count sees no statement"
    beyond_the_run_list = [s for s in others.reads() if "FROM runs" not in s]
    assert not beyond_the_run_list, beyond_the_run_list[:5]
    assert not others.connections


def test_a_live_refresh_opens_no_connection(live_capture: SQLRecorder) -> None:
    at = _overview()
    _write_steps(live_capture, range(3, 6))
    time.sleep(data.LIVE_TTL_S + 0.1)  # NOTE: the run list (so the read stamp) is cached for LIVE_TTL_S
    with counted_sql() as refresh:
        at.run()
    assert not at.exception
    assert {m.label: m.value for m in at.metric}["running / waiting"] == "2 / 5"  # step 5's sample: a new stamp
    assert refresh.reads(), "the refresh read nothing"
    assert refresh.connections == 0, f"{refresh.connections} connections opened by one refresh"


def test_sessions_at_one_stamp_share_one_usage_chart(
    live_capture: SQLRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    real = charts.live_usage_figure

    def counted(usage: Any, x: str = "step") -> Any:
        built.append(len(usage))
        return real(usage, x)

    monkeypatch.setattr(charts, "live_usage_figure", counted)
    for _ in range(NUM_SESSIONS):
        at = _overview()
        assert at.get("plotly_chart"), "the Overview shows no usage chart"
    assert built == [3], f"the usage chart was built {len(built)} times for {NUM_SESSIONS} sessions at one stamp"
