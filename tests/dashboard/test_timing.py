"""Wall-clock times and request latency: the pure conversions, and the Requests page on real
captures (one written now, with the clock anchor in its config, and an older sample without)."""

from __future__ import annotations

import json
import math
import sqlite3
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard.latency import BOX_POINTS_MAX, latency_figure
from kvscope.dashboard.timing import LATENCIES, Clock, clock_of, latencies, latency_percentiles, throughput
from kvscope.telemetry import PoolTerms, RequestRecord, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard.conftest import ROOT

TIMEOUT_S = 60


def test_the_config_anchor_wins_and_older_captures_fall_back_to_started_at() -> None:
    anchored = clock_of({"clock": {"wall_s": 1_700_000_000.0, "mono_s": 500.0}}, 1.0, 9.0)
    assert anchored == Clock(1_700_000_000.0, 500.0, True)
    assert anchored.wall(512.5) == 1_700_000_012.5
    assert clock_of({}, 1_700_000_000.0, 40.0) == Clock(1_700_000_000.0, 40.0, False)
    assert clock_of({"clock": {"wall_s": "x", "mono_s": None}}, 1_700_000_000.0, 40.0) == Clock(
        1_700_000_000.0, 40.0, False
    )
    assert clock_of({}, None, 40.0) is None and clock_of({}, 1.0, float("nan")) is None


def test_a_time_is_shown_as_local_wall_time_to_the_millisecond() -> None:
    clock = Clock(1_700_000_000.0, 100.0, True)
    expected = datetime.fromtimestamp(1_700_000_002.25).astimezone()
    assert clock.stamp(102.25) == expected.strftime("%Y-%m-%d %H:%M:%S") + ".250"
    assert clock.stamp(None) == "–" and clock.stamp(float("nan")) == "–"
    shown = clock.datetimes(pd.Series([102.25, None]))
    assert shown.iloc[0].timestamp() == pytest.approx(1_700_000_002.25) and pd.isna(shown.iloc[1])


def requests_frame() -> pd.DataFrame:
    """Four requests (seconds): queue 1, 2, 3 and one never admitted; one never finished."""
    return pd.DataFrame(
        {
            "rid": ["a", "b", "c", "d"],
            "status": ["finished", "finished", "in_flight", "unfinished"],
            "arrive_t": [10.0, 10.0, 10.0, 10.0],
            "admit_t": [11.0, 12.0, 13.0, None],
            "first_token_t": [11.5, 12.5, 13.5, None],
            "finish_t": [14.0, 16.0, None, None],
        }
    )


def test_latencies_leave_out_the_stages_a_request_never_reached() -> None:
    ms = latencies(requests_frame())
    assert ms["queue"].tolist()[:3] == [1000.0, 2000.0, 3000.0] and math.isnan(ms["queue"].iloc[3])
    assert ms["end to end"].dropna().tolist() == [4000.0, 6000.0]
    table = latency_percentiles(ms).set_index("latency")
    assert table.loc["queue", "requests"] == 3 and table.loc["end to end", "requests"] == 2
    assert table.loc["queue", "p50 (ms)"] == 2000.0  # the median of 1, 2, 3 s; never the missing one as 0
    assert table.loc["queue", "p90 (ms)"] == pytest.approx(2800.0)  # linear between 2 and 3 s
    assert table.loc["time to first token", "max (ms)"] == 3500.0
    assert table.loc["end to end", "p99 (ms)"] == pytest.approx(5980.0)


def test_hit_rate_and_tokens_per_second_come_from_the_running_totals() -> None:
    usage = pd.DataFrame(
        {
            "step": [0, 1, 2, 3],
            "t_mono": [100.0, 101.0, 102.0, 104.0],
            "cum_prompt_tokens": [0, 100, 300, 300],
            "cum_hit_tokens": [0, 50, 200, 200],
        }
    )
    series = throughput(usage, Clock(1_700_000_000.0, 100.0, True), window_rows=1)
    assert series["hit rate so far"].tolist()[1:] == [0.5, 200 / 300, 200 / 300]
    assert series["hit rate (window)"].iloc[2] == 0.75  # 150 of the 200 prompt tokens in (101, 102]
    assert math.isnan(series["hit rate (window)"].iloc[3])  # nothing admitted: no rate, not 0 %
    assert series["prompt tokens/s"].tolist()[1:] == [100.0, 200.0, 0.0]
    assert series["cached tokens/s"].iloc[2] == 150.0
    assert series["time"].iloc[3].timestamp() == pytest.approx(1_700_000_004.0)


def open_page(db: Path, page: str, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT_S)
    at.switch_page(f"kvscope/dashboard/app_pages/{page}.py")
    return at.run()


def record_requests(db: Path) -> dict[str, float]:
    """A closed run with two requests and usage samples; returns its clock anchor."""
    with SQLRecorder(db, level="summary", label="timing") as rec:
        for step in range(3):
            rec.step = step
            rec.usage(
                UsageSample(step, PoolTerms(100, 80, 10, 0), None, 4, 4, 0, 0, 50 * step, 20 * step, step, step, 0, 0)
            )
        for rid, queue_s in (("r1", 0.010), ("r2", 0.030)):
            record = RequestRecord(rid, "u", 50, status="finished", output_len=4)
            for moment, offset in (
                ("arrive", 0.0),
                ("admit", queue_s),
                ("first_token", queue_s + 0.005),
                ("finish", queue_s + 0.100),
            ):
                record.mark(moment, 0, 1000.0 + offset)
            rec.request(record)
    with sqlite3.connect(db) as conn:
        (config,) = conn.execute("SELECT config FROM runs").fetchone()
    return dict(json.loads(config)["clock"])


def test_requests_page_shows_latency_percentiles_and_wall_clock_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "timing.db"
    anchor = record_requests(db)
    at = open_page(db, "requests", monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value.set_index("latency")
    assert table.loc["queue", "p50 (ms)"] == pytest.approx(20.0)
    assert table.loc["time to first token", "max (ms)"] == pytest.approx(35.0)
    assert table.loc["end to end", "requests"] == 2
    rows = at.dataframe[-1].value.set_index("rid")
    wall = anchor["wall_s"] + (1000.0 - anchor["mono_s"])
    assert rows.loc["r1", "arrive"].timestamp() == pytest.approx(wall, abs=1e-3)
    assert rows.loc["r2", "queue (ms)"] == pytest.approx(30.0)
    assert "arrive_t" not in rows.columns  # no monotonic seconds on the page
    # NOTE: by default the columns that fit a 1440 px window; the steps and other moments on request
    assert list(rows.columns) == [
        "principal",
        "status",
        "arrive",
        "queue (ms)",
        "time to first token (ms)",
        "end to end (ms)",
        "prompt_len",
        "cached_tokens",
        "output_len",
        "num_retractions",
    ]
    at.toggle(key="requests.all_columns").set_value(True).run()
    every = at.dataframe[-1].value.columns
    assert {"admit", "finish", "arrive_step", "finish_step"} <= set(every)


def test_an_older_capture_without_the_anchor_shows_times_from_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    db = ROOT / "tests" / "telemetry" / "data" / "schema_v2.db"  # a sample as schema version 2 wrote it
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (started_at, config) = conn.execute("SELECT started_at, config FROM runs WHERE id = 1").fetchone()
        (first_t,) = conn.execute("SELECT t_mono FROM events WHERE run_id = 1 ORDER BY seq LIMIT 1").fetchone()
        (arrive_t,) = conn.execute("SELECT arrive_t FROM requests WHERE rid = 'sp-00005'").fetchone()
    assert "clock" not in json.loads(config)
    at = open_page(db, "requests", monkeypatch)
    assert not at.exception
    rows = at.dataframe[-1].value.set_index("rid")
    # started_at is the wall time of the run's first event
    assert rows.loc["sp-00005", "arrive"].timestamp() == pytest.approx(started_at + arrive_t - first_t, abs=1e-3)


def test_the_latency_boxes_of_many_requests_are_computed_here() -> None:
    """Past BOX_POINTS_MAX requests a box carries five numbers (plotly's: quartiles, whiskers at
    the furthest values within 1.5 IQR) and no points; fewer requests send their values."""
    rng = np.random.default_rng(0)
    many = pd.DataFrame({name: rng.exponential(10.0, BOX_POINTS_MAX + 1) for name in LATENCIES})
    for trace in latency_figure(many).data:
        values = many[trace.name].to_numpy()
        q1, median, q3 = np.percentile(values, [25, 50, 75])
        assert trace.x is None and trace.boxpoints is False
        assert (trace.q1[0], trace.median[0], trace.q3[0]) == pytest.approx((q1, median, q3))
        assert trace.upperfence[0] == values[values <= q3 + 1.5 * (q3 - q1)].max()
        assert trace.lowerfence[0] == values.min()  # NOTE: nothing lies below q1 - 1.5 IQR here
    few = many.head(100)
    assert all(len(trace.x) == 100 and trace.boxpoints == "outliers" for trace in latency_figure(few).data)
