"""Times the pages show are times (to the millisecond) or say what they are, and the latency and
eviction tables fit beside the sidebar (fixed column widths, about 800 px in all)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from kvscope.telemetry import Capture
from tests.dashboard.conftest import ROOT
from tests.dashboard.test_pages import open_app, page_path

LEAKY = ROOT / "sample_runs" / "leaky.db"  # radix: accesses stamped in monotonic seconds
SWA = ROOT / "sample_runs" / "hybrid-swa.db"  # swa-radix: accesses stamped with a counter
FITS_PX = 800  # NOTE: the main column beside the sidebar on a 1280-px-wide window


def columns_of(table: Any) -> dict[str, Any]:
    return dict(json.loads(table.proto.columns))


def shown_width(table: Any) -> int:
    """The table's width in px when every shown column has a fixed width (else it fails)."""
    config, order = columns_of(table), list(table.proto.column_order)
    shown = order or [c for c in table.value.columns]
    assert all("width" in config.get(c, {}) for c in shown), {c: config.get(c) for c in shown}
    return sum(int(config[c]["width"]) for c in shown)


def node_fields(at: AppTest) -> dict[str, str]:
    """The Radix tree page's node details (a field / value table)."""
    table = next(d for d in at.dataframe if list(d.value.columns) == ["field", "value"])
    return dict(zip(table.value["field"], table.value["value"], strict=True))


def test_a_counter_clock_cache_shows_its_access_order_not_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(SWA, monkeypatch)
    at.switch_page(page_path("tree")).run()
    assert not at.exception
    node = int(at.selectbox(key="tree.node").options[1])
    at.selectbox(key="tree.node").set_value(node).run()
    shown, step = node_fields(at), int(at.slider(key="tree.step").value)
    capture = Capture(SWA)
    raw = capture.tree_at(1, step).set_index("node_id").loc[node, "last_access_time"]
    capture.close()
    assert shown["last access (order)"] == f"{int(raw):,}"  # the counter, not a date before the run
    assert "idle (accesses since)" in shown


def test_a_clock_cache_shows_access_times_to_the_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(LEAKY, monkeypatch)
    at.switch_page(page_path("tree")).run()
    shown = node_fields(at)["last access (wall clock)"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", shown), shown


def test_request_times_are_shown_to_the_millisecond_and_latencies_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(LEAKY, monkeypatch)
    at.switch_page(page_path("requests")).run()
    assert not at.exception
    latencies, requests = at.dataframe[0], at.dataframe[-1]
    assert shown_width(latencies) <= FITS_PX
    config = columns_of(requests)
    for name in ("arrive", "admit", "first token", "finish"):
        assert config[name]["type_config"]["format"].endswith("ss.SSS"), name


def test_the_eviction_log_shows_wall_clock_times_and_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(LEAKY, monkeypatch)
    at.switch_page(page_path("evictions")).run()
    assert not at.exception
    log = at.dataframe[-1]
    order = list(log.proto.column_order)
    assert "t_mono" not in order and "seq" not in order and "time" in order
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", t) for t in log.value["time"]), log.value["time"].head()
    assert shown_width(log) <= FITS_PX
    capture = Capture(LEAKY)
    counts = capture.event_counts(1)
    capture.close()
    assert len(log.value) == min(int(counts.loc[counts["kind"] == "evict", "count"].sum()), 200) > 0
