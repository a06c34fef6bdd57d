"""A capture still being written shows as running with the live panel refreshing; closed, it is finished.
And the eviction log's age / idle / regret on a capture built event by event."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import data, live
from kvscope.dashboard.frame import Selection
from kvscope.telemetry import (
    EventKind,
    EvictReason,
    PoolName,
    PoolTerms,
    RequestRecord,
    RequestStatus,
    UsageSample,
    derived,
)
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


def grow(recorder: SQLRecorder, steps: range) -> None:
    """Steps of a running run: a usage sample, an eviction and a finished request each."""
    for step in steps:
        recorder.step = step
        recorder.usage(sample(step))
        recorder.record(
            EventKind.EVICT, pool=PoolName.FULL, node_id=step + 1, num_tokens=4, reason=EvictReason.CAPACITY
        )
        record = RequestRecord(f"r{step}", "u0", 8, status=RequestStatus.FINISHED)
        for moment in ("arrive", "admit", "first_token", "finish"):
            record.mark(moment, step, 1.0 + step)
        recorder.request(record)
    recorder.flush()


@pytest.mark.parametrize(("page", "label"), [("evictions", "evictions"), ("requests", "requests")])
def test_a_live_page_refreshes_and_its_rows_follow_the_run(
    tmp_path: Path, page: str, label: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = SQLRecorder(tmp_path / "live.db", level="full", label="live")
    try:
        grow(recorder, range(3))
        monkeypatch.setenv("KVSCOPE_DB", str(tmp_path / "live.db"))
        monkeypatch.chdir(ROOT)
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
        at.switch_page(f"kvscope/dashboard/app_pages/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        assert {m.label: m.value for m in at.metric}[label] == "3"
        assert any("this page refreshes every second" in c.value for c in at.main.caption)
        grow(recorder, range(3, 5))
        time.sleep(data.LIVE_TTL_S + 0.1)
        at.run()
        assert {m.label: m.value for m in at.metric}[label] == "5"
    finally:
        recorder.close()
    time.sleep(data.LIVE_TTL_S + 0.1)
    at.run()
    assert not any("refreshes every second" in c.value for c in at.caption)


def test_the_tree_says_it_refreshes_while_the_run_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = SQLRecorder(tmp_path / "live.db", level="full", label="live")
    try:
        grow(recorder, range(3))
        monkeypatch.setenv("KVSCOPE_DB", str(tmp_path / "live.db"))
        monkeypatch.chdir(ROOT)
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
        at.switch_page("kvscope/dashboard/app_pages/tree.py").run()
        assert not at.exception, [e.value for e in at.exception]
        assert any("this page refreshes every second" in c.value for c in at.main.caption)
    finally:
        recorder.close()


def test_a_fragment_rerun_reads_the_runs_newest_stamp(tmp_path: Path) -> None:
    """A live fragment reruns without app.py's frame: its selection's stamp (the key of every read)
    must still move as the run flushes, or its page would stay at the step it opened on."""
    recorder = SQLRecorder(tmp_path / "live.db", level="full", label="live")
    try:
        grow(recorder, range(3))
        runs = data.runs(str(tmp_path / "live.db"))
        run = runs.iloc[0]
        opened = Selection(str(tmp_path / "live.db"), int(run["id"]), run, 0.0, True, "running", None)
        time.sleep(1.2)  # NOTE: the heartbeat (the stamp) is stored in whole milliseconds or coarser
        grow(recorder, range(3, 5))
        time.sleep(data.LIVE_TTL_S + 0.1)
        now = live.refreshed(opened)
        assert now.stamp > float(run["heartbeat_at"]) and now.status == "running"
        assert int(data.step_range(now.path, now.run_id, now.stamp).iloc[0]["hi"]) == 4
    finally:
        recorder.close()


def test_the_live_requests_table_opens_on_the_newest_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """70 finished requests (more than a page): while the run runs, page 1 holds the newest; once it
    closed, the table opens on the first ones, by arrival."""
    recorder = SQLRecorder(tmp_path / "live.db", level="full", label="live")
    try:
        grow(recorder, range(70))
        monkeypatch.setenv("KVSCOPE_DB", str(tmp_path / "live.db"))
        monkeypatch.chdir(ROOT)
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
        at.switch_page("kvscope/dashboard/app_pages/requests.py").run()
        assert not at.exception, [e.value for e in at.exception]
        shown = at.dataframe[-1].value
        assert list(shown.iloc[:, 0][:2]) == ["r69", "r68"], shown.head()
    finally:
        recorder.close()
    time.sleep(data.LIVE_TTL_S + 0.1)
    at.run()
    assert list(at.dataframe[-1].value.iloc[:, 0][:2]) == ["r0", "r1"]


def test_the_live_requests_page_shows_the_requests_in_flight_newest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's record is written when it ends; while the run runs, the page lists the requests that
    arrived and have not ended from their events: admitted ones running, the others waiting, newest
    first; one that finished is not among them. Closed, the run has none in flight and no such list."""
    recorder = SQLRecorder(tmp_path / "live.db", level="full", label="live")
    try:
        grow(recorder, range(3))
        lives = {"done": ("arrive", "admit", "finish"), "old": ("arrive", "admit"), "new": ("arrive",)}
        kinds = {
            "arrive": EventKind.REQUEST_ARRIVE,
            "admit": EventKind.REQUEST_ADMIT,
            "finish": EventKind.REQUEST_FINISH,
        }
        for rid, moments in lives.items():
            for moment in moments:
                recorder.record(kinds[moment], rid=rid, num_tokens=8)
        grow(recorder, range(3, 5))
        monkeypatch.setenv("KVSCOPE_DB", str(tmp_path / "live.db"))
        monkeypatch.chdir(ROOT)
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
        at.switch_page("kvscope/dashboard/app_pages/requests.py").run()
        assert not at.exception, [e.value for e in at.exception]
        assert "In flight at step 4: 1 running, 1 waiting" in [h.value for h in at.subheader]
        shown = at.dataframe[0].value
        assert list(zip(shown["rid"], shown["state"], strict=True)) == [("new", "waiting"), ("old", "running")]
    finally:
        recorder.close()
    time.sleep(data.LIVE_TTL_S + 0.1)
    at.run()
    assert not any(h.value.startswith("In flight") for h in at.subheader)
