"""Overview, Memory and Capacity through the real app (AppTest) on the sample captures: the leak
verdict whole and in colour, leaked tokens as missing, rates over the run's real length, slots
shared between requests counted once, and the capacity curve on the working set's scale."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import gpu
from kvscope.debug import build_report, verdict
from kvscope.telemetry import EventKind, EvictReason, PoolName, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard.conftest import ROOT
from tests.dashboard.test_pages import open_app, page_path

LEAKY = ROOT / "sample_runs" / "leaky.db"
CLEAN = ROOT / "sample_runs" / "shared-prefix.db"
SWA = ROOT / "sample_runs" / "hybrid-swa.db"


def check_reason(path: Path) -> str:
    """`kvscope check`'s line on the capture's last run (what it prints after the path)."""
    return verdict(build_report(path)).reason


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def copy_with_status(tmp_path: Path, status: str, error: str | None = None) -> Path:
    path = tmp_path / f"{status.replace(' ', '-')}.db"
    shutil.copyfile(CLEAN, path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET status = ?, error = ?", (status, error))
    return path


def test_a_failed_leak_check_is_shown_whole_in_red(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(LEAKY, monkeypatch)
    assert not at.exception and not at.success and len(at.error) == 1
    verdict = at.error[0].value
    assert verdict.startswith(f"**{check_reason(LEAKY)}**")
    assert "idle leak check failed at step 38" in verdict
    # the check's own message, whole: every term and the gap
    assert (
        "[full] total=2048, available=260, evictable=988, protected=760, held=0, uncached=0: 40 tokens missing"
        in verdict
    )
    assert "760 tokens still locked at an idle point" in verdict


def test_leaked_tokens_are_missing_not_held_when_no_request_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = metrics(open_app(LEAKY, monkeypatch))
    assert shown["running / waiting"] == "0 / 0"
    assert shown["full: missing"] == "40"
    assert "full: held by requests" not in shown
    assert shown["full: total"] == "2,048"


def test_every_pool_shows_its_total(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = metrics(open_app(SWA, monkeypatch))
    assert shown["full: total"] == "2,048" and shown["swa: total"] == "1,638"


def test_a_clean_finished_run_is_green(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(CLEAN, monkeypatch)
    assert not at.error and not at.warning
    assert at.success[0].value == f"**{check_reason(CLEAN)}**"
    assert check_reason(CLEAN).startswith("clean: 1 idle leak check balanced")


@pytest.mark.parametrize(
    ("status", "error", "reason"),
    [
        ("interrupted", None, "the run was interrupted"),
        ("crashed", "RuntimeError: boom", "the run crashed (RuntimeError: boom)"),
        (
            "incomplete",
            "capture complete through step 30: database or disk is full",
            "the capture is incomplete (capture complete through step 30: database or disk is full)",
        ),
        ("running", None, "the run ended without closing"),  # its heartbeat is long stale
    ],
)
def test_a_run_that_did_not_finish_is_inconclusive_not_clean(
    tmp_path: Path, status: str, error: str | None, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = copy_with_status(tmp_path, status, error)
    at = open_app(path, monkeypatch)
    assert not at.exception and not at.success and not at.error
    assert at.warning[0].value.startswith(f"**inconclusive: {reason}")
    assert at.warning[0].value == f"**{check_reason(path)}**"


def test_a_leak_in_a_run_that_did_not_finish_is_still_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "leaky-crashed.db"
    shutil.copyfile(LEAKY, path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET status = 'crashed', error = 'RuntimeError: boom'")
    at = open_app(path, monkeypatch)
    assert "idle leak check failed at step 38" in at.error[0].value and not at.warning
    assert at.error[0].value.startswith(f"**{check_reason(path)}**")


def test_a_finished_run_counts_evictions_over_its_whole_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """hybrid-swa: 10 evictions in a 0.3 s run; a rate over the last few steps said 35.9/s."""
    at = open_app(SWA, monkeypatch)
    shown = {m.label: m for m in at.metric}
    assert not [label for label in shown if "/ s" in label]
    assert shown["evictions (whole run)"].value == "10"
    with sqlite3.connect(SWA) as conn:
        started, ended = conn.execute("SELECT started_at, ended_at FROM runs").fetchone()
    assert f"{10 / (ended - started):.1f} per second on average over its {ended - started:.1f} s" in (
        shown["evictions (whole run)"].help
    )


def test_running_requests_slots_count_a_shared_prefix_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """leaky (page size 4): the per-request sum said 4,996 slots in a 2,048-slot pool."""
    at = open_app(LEAKY, monkeypatch)
    at.switch_page(page_path("memory")).run()
    assert not at.exception
    step = at.slider(key="memory.step").value
    with sqlite3.connect(LEAKY) as conn:
        total, available, evictable = conn.execute(
            "SELECT full_total, full_available, full_evictable FROM usage WHERE step = ?", (step,)
        ).fetchone()
    held, of = metrics(at)["running requests' slots"].split(" of ")
    assert int(of.replace(",", "")) == total == 2048
    assert int(held.replace(",", "")) == total - available - evictable <= total


def plotted(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def test_capacity_curve_spans_the_working_set_not_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(CLEAN, monkeypatch)
    at.switch_page(page_path("capacity")).run()
    gpu_tokens = int(metrics(at)["max KV tokens (SGLang)"].replace(",", ""))
    x_max = plotted(at)[0]["layout"]["xaxis"]["range"][1]
    # shared-prefix: the hit rate stops growing at 1,244 tokens; the GPU holds ~450,000
    assert 1244 <= x_max < 2 * 1244 < gpu_tokens


def test_capacity_keeps_the_curve_when_the_model_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(CLEAN, monkeypatch)
    at.switch_page(page_path("capacity")).run()
    at.number_input(key="capacity.gpu").set_value(8.0).run()
    assert not at.exception
    assert "do not fit" in at.error[0].value
    curve = plotted(at)
    assert len(curve) == 1 and curve[0]["data"][0]["name"] == "token hit rate"
    assert any(m.label == "capacity for 50%" for m in at.metric)


def test_gpu_memory_comes_from_the_probes_own_columns() -> None:
    """The probe returns memory_total_mib (the capacity page read a 'total_bytes' it never had)."""
    h100 = pd.DataFrame([[0, "NVIDIA H100 80GB HBM3", 1_000, 81_559, 0]], columns=gpu.COLUMNS)
    assert gpu.total_gib(h100) == pytest.approx(79.65, abs=0.01)
    assert gpu.total_gib(pd.DataFrame(columns=gpu.COLUMNS)) is None


@pytest.mark.cuda
def test_capacity_page_defaults_to_this_machines_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    probed = gpu.probe()
    if probed.empty:
        pytest.skip("pynvml sees no GPU")
    at = open_app(CLEAN, monkeypatch)
    at.switch_page(page_path("capacity")).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.number_input(key="capacity.gpu").value == round(float(probed["memory_total_mib"].iloc[0]) / 1024, 1)


def test_a_running_run_shows_a_labelled_recent_rate_and_no_verdict_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "live.db"
    recorder = SQLRecorder(db, level="full", label="live")
    try:
        for step in range(3):
            recorder.step = step
            recorder.usage(UsageSample(step, PoolTerms(100, 60, 30, 10), None, 4, 2, 2, 0, 0, 0, 0, 0, 0, 0))
            recorder.record(
                EventKind.EVICT, pool=PoolName.FULL, node_id=step, num_tokens=4, reason=EvictReason.CAPACITY
            )
        recorder.flush()
        at = open_app(db, monkeypatch)
        assert not at.exception
        labels = [m.label for m in at.metric]
        assert any(label.startswith("evictions / s (last ") for label in labels), labels
        assert "evictions (whole run)" not in labels
        assert at.warning[0].value.startswith(
            "**inconclusive: the run is still running at step 2; 0 idle leak checks balanced so far"
        )
    finally:
        recorder.close()
