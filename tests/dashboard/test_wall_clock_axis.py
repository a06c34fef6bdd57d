"""Memory and the Overview plot the run over its steps or, picked, over wall-clock time (to line a
chart up with an incident's time), through the real app (AppTest) on real captures: an engine run,
an attached engine; a capture without timestamps says so in one line and offers no choice."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import attached
from kvscope.dashboard.timing import clock_of
from kvscope.telemetry import Capture
from tests.dashboard.conftest import ROOT
from tests.dashboard.test_attached import vllm_like
from tests.dashboard.test_pages import open_app, page_path

LEAKY = ROOT / "sample_runs" / "leaky.db"
NO_TIMES = "This capture has no timestamps for its steps: the x axis is the step."


def chart(at: AppTest, key: str) -> dict[str, Any]:
    found = next(c for c in at.get("plotly_chart") if c.proto.id.endswith(key))
    return dict(json.loads(found.proto.spec))


def first_wall_time(db: Path) -> pd.Timestamp:
    """The wall-clock time of the run's first usage row, by the run's own clock."""
    capture = Capture(db)
    try:
        run = capture.runs().iloc[0]
        usage = capture.usage(1)
    finally:
        capture.close()
    clock = clock_of(attached.run_config(run), run["started_at"], float(usage["t_mono"].iloc[0]))
    assert clock is not None
    return clock.datetimes(usage["t_mono"]).iloc[0].tz_localize(None)


def opened(db: Path, page: str, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    at = open_app(db, monkeypatch)
    if page != "overview":
        at.switch_page(page_path(page)).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.mark.parametrize(
    ("capture", "page", "key"),
    [
        ("engine", "memory", "memory.timeline"),
        ("engine", "overview", "overview.usage"),
        ("attached", "memory", "attached.memory.tokens"),
    ],
)
def test_a_chart_over_the_run_can_use_wall_clock_time(
    capture: str, page: str, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = LEAKY if capture == "engine" else vllm_like(tmp_path / "vllm.db")
    at = opened(db, page, monkeypatch)
    picker = next(r for r in at.radio if r.label == "x axis")
    assert picker.value == "step" and chart(at, key)["layout"]["xaxis"]["title"]["text"] == "step"
    picker.set_value("wall-clock time").run()
    assert not at.exception, [e.value for e in at.exception]
    fig = chart(at, key)
    assert fig["layout"]["xaxis"]["type"] == "date" and fig["layout"]["xaxis"]["title"]["text"] == "wall-clock time"
    assert pd.Timestamp(fig["data"][0]["x"][0]) == first_wall_time(db)
    assert "step %{customdata}" in fig["data"][0]["hovertemplate"]  # the hover still names the step


def test_a_capture_without_timestamps_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No clock anchor and a start time that is no number (kvscope writes both: a damaged or foreign
    file): no time to show, one line says so."""
    db = tmp_path / "no-clock.db"
    shutil.copy(LEAKY, db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET started_at = 'unknown', config = json_remove(config, '$.clock')")
    conn.close()
    for page in ("memory", "overview"):
        at = opened(db, page, monkeypatch)
        assert not [r for r in at.radio if r.label == "x axis"]
        assert [c.value for c in at.caption].count(NO_TIMES) == 1
