"""A capture still being written shows as running with the live panel refreshing; closed, it is finished.
And the eviction log's age / idle / regret on a capture built event by event."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import data
from kvscope.telemetry import EventKind, EvictReason, PoolName, PoolTerms, UsageSample, derived
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard.conftest import ROOT


def sample(step: int) -> UsageSample:
    return UsageSample(step, PoolTerms(100, 60, 30, 10), None, 4, 2, 2, step, 10 * step, 5 * step, step, step, 0, 0)


def test_a_running_capture_refreshes_live_until_it_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "live.db"
    recorder = SQLRecorder(db, level="full", label="live-test")
    try:
        for step in range(3):
            recorder.step = step
            recorder.usage(sample(step))
        recorder.flush()
        monkeypatch.setenv("KVSCOPE_DB", str(db))
        monkeypatch.chdir(ROOT)
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
        assert not at.exception
        assert at.sidebar.selectbox(key="kvscope.run").options == ["run 1 · live-test · running"]
        assert "running** · refreshing every second" in at.caption[0].value
        assert {m.label: m.value for m in at.metric}["running / waiting"] == "2 / 2"
        recorder.step = 3
        recorder.usage(sample(3))
        recorder.flush()
        time.sleep(data.LIVE_TTL_S + 0.1)  # the run list (and so the read stamp) is cached for LIVE_TTL_S
        at.run()
        assert {m.label: m.value for m in at.metric}["running / waiting"] == "2 / 3"
        at.sidebar.toggle(key="kvscope.refresh").set_value(False).run()
        assert "refreshing" not in at.caption[0].value
        at.sidebar.toggle(key="kvscope.refresh").set_value(True).run()
    finally:
        recorder.close()
    time.sleep(data.LIVE_TTL_S + 0.1)
    at.run()
    assert not at.exception
    assert at.sidebar.selectbox(key="kvscope.run").options == ["run 1 · live-test · finished"]
    assert "finished" in at.caption[0].value and "refreshing" not in at.caption[0].value


def test_eviction_log_measures_age_idle_and_regret(tmp_path: Path) -> None:
    db = tmp_path / "evict.db"
    slots = np.arange(10, dtype=np.int64)
    with SQLRecorder(db, level="full") as rec:
        for step, kind, kw in (
            (0, EventKind.INSERT, {"node_id": 1, "aux": 0, "num_tokens": 10, "rid": "a"}),
            (1, EventKind.INSERT, {"node_id": 2, "aux": 1, "num_tokens": 10, "rid": "b"}),
            (2, EventKind.MATCH, {"node_id": 2, "num_tokens": 20, "aux": 0, "rid": "c"}),
            (5, EventKind.EVICT, {"node_id": 2, "num_tokens": 10, "reason": EvictReason.CAPACITY, "slots": slots}),
            (7, EventKind.MATCH, {"node_id": 1, "num_tokens": 10, "aux": 4, "rid": "d"}),
        ):
            rec.step = step
            rec.record(kind, pool=PoolName.FULL, **kw)
    capture = Capture(db)
    log = derived.eviction_log(capture, 1, limit=10, offset=0)
    capture.close()
    row = log.iloc[0]
    assert (row.age_steps, row.idle_steps, row.parent_id) == (4, 3, 1)
    assert (row.needed_again_step, row.needed_again_by, row.regret_tokens) == (7, "d", 4)
