"""A run stopped with requests in flight (interrupted): the Requests page draws them (an admitted
request still in prefill has no first-token step), and the Leaks page and the Overview give the
same verdict as `kvscope check`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvscope.telemetry import EventKind, PoolName, PoolTerms, RequestRecord, RequestStatus, RunStatus, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard.conftest import ROOT
from tests.dashboard.test_pages import open_app, page_path


def sample(step: int, num_running: int) -> UsageSample:
    return UsageSample(
        step, PoolTerms(100, 60, 30, 10), None, 4, 2, num_running, 1, 10 * step, 5 * step, step, step, 0, 0
    )


def interrupted_capture(path: Path) -> Path:
    """Request a finished; b was admitted at step 2 and was prefilling in chunks when the run was
    interrupted at step 4 (no first token); c was still waiting."""
    recorder = SQLRecorder(path, level="full", label="stopped")
    records = {rid: RequestRecord(rid, "u0", 40) for rid in ("a", "b", "c")}
    for rid, record in records.items():
        record.mark("arrive", 0, 1.0)
        recorder.step = 0
        recorder.record(EventKind.REQUEST_ARRIVE, rid=rid, num_tokens=40)
    for step in range(5):
        recorder.step = step
        if step == 1:
            records["a"].mark("admit", 1, 1.1)
            records["a"].mark("first_token", 1, 1.2)
        if step == 2:
            records["a"].mark("finish", 2, 1.3)
            records["a"].status = RequestStatus.FINISHED
            recorder.request(records["a"])
        if step >= 2:
            records["b"].mark("admit", 2, 1.3) if step == 2 else None
            recorder.record(
                EventKind.ALLOC,
                pool=PoolName.FULL,
                rid="b",
                num_tokens=8,
                slots=np.arange(8 * step, 8 * step + 8, dtype=np.int64),
            )
        recorder.usage(sample(step, 1 if step >= 2 else 0))
    for rid in ("b", "c"):
        records[rid].status = RequestStatus.IN_FLIGHT
        recorder.request(records[rid])
    recorder.close(RunStatus.INTERRUPTED, "SIGINT at step 4")
    return path


@pytest.fixture
def stopped(tmp_path: Path) -> Path:
    return interrupted_capture(tmp_path / "stopped.db")


def test_the_requests_page_draws_a_request_still_in_prefill(stopped: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(stopped, monkeypatch)
    at.switch_page(page_path("requests")).run()
    assert not at.exception, [e.value for e in at.exception]
    at.selectbox(key="requests.rid").set_value("b").run()
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[-1].value
    assert list(table["rid"]) == ["b"] and list(table["status"]) == ["in_flight"]


def check_line(path: Path) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(path)], capture_output=True, text=True, cwd=ROOT, check=False
    )
    return done.returncode, done.stdout.split(": ", 1)[1].strip()


def verdicts_shown(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """(the Overview's verdict box, the Leaks page's box, the Leaks page's verdict metric)."""
    at = open_app(path, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    overview = at.warning[0].value
    at.switch_page(page_path("leaks")).run()
    assert not at.exception, [e.value for e in at.exception]
    return overview, at.warning[0].value, {m.label: m.value for m in at.metric}["verdict"]


def test_an_interrupted_run_without_an_idle_check_is_inconclusive_on_every_page(
    stopped: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, line = check_line(stopped)
    assert code == 3 and line.startswith("inconclusive: the run was interrupted (SIGINT at step 4)"), line
    assert verdicts_shown(stopped, monkeypatch) == (f"**{line}**", f"**{line}**", "inconclusive")


def test_a_running_run_is_inconclusive_on_every_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "live.db"
    recorder = SQLRecorder(path, level="full", label="live")
    try:
        for step in range(3):
            recorder.step = step
            recorder.usage(sample(step, 1))
        recorder.flush()
        code, line = check_line(path)
        assert code == 3 and line.startswith("inconclusive: the run is still running"), line
        assert verdicts_shown(path, monkeypatch) == (f"**{line}**", f"**{line}**", "inconclusive")
    finally:
        recorder.close()
