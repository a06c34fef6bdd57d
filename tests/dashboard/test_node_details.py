"""The Radix tree page's node details, through the real app (AppTest) on real captures: a field /
value table whose names carry their units and that fits beside the sidebar, page hashes as short
hex, and a click on an icicle node picks it (the picker, the table and the URL follow; the
picker stays free afterwards)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import node_details
from kvscope.telemetry import Capture
from tests.dashboard.conftest import ROOT
from tests.dashboard.test_pages import page_path
from tests.dashboard.test_times_and_widths import FITS_PX, LEAKY, shown_width
from tests.fleet.fleet_capture import hashes_of, write_fleet


def tree_page(db: Path, monkeypatch: pytest.MonkeyPatch, run_id: int = 1) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.query_params["run"] = str(run_id)
    at.switch_page(page_path("tree")).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def details(at: AppTest) -> Any:
    return next(d for d in at.dataframe if list(d.value.columns) == ["field", "value"])


def fields(at: AppTest) -> dict[str, str]:
    return dict(zip(details(at).value["field"], details(at).value["value"], strict=True))


def click(at: AppTest, node: int) -> None:
    """What the browser sends when a person clicks an icicle node: the chart's selection, a point
    with the node's id (Streamlit's frontend reads it from plotly's click on a hierarchical chart)."""
    chart = next(c for c in at.get("plotly_chart") if c.proto.id.endswith("tree.icicle"))
    states = at._tree.get_widget_states()
    state = states.widgets.add()
    state.id = chart.proto.id
    point = {"id": str(node), "parent": "0", "label": f"#{node}", "pointNumber": 1, "curveNumber": 0}
    state.string_value = json.dumps({"selection": {"points": [point], "point_indices": [1], "box": [], "lasso": []}})
    at._run(states)
    assert not at.exception, [e.value for e in at.exception]


def test_node_details_name_their_units_and_fit_beside_the_sidebar(monkeypatch: pytest.MonkeyPatch) -> None:
    at = tree_page(LEAKY, monkeypatch)
    step = int(at.slider(key="tree.step").value)
    node = int(at.selectbox(key="tree.node").options[1])
    at.selectbox(key="tree.node").set_value(node).run()
    assert shown_width(details(at)) <= FITS_PX
    shown = fields(at)
    capture = Capture(LEAKY)
    row = capture.tree_at(1, step).set_index("node_id").loc[node]
    capture.close()
    assert shown["node"] == f"#{node}" and shown["tokens (the node's own)"] == f"{int(row['num_tokens']):,}"
    assert shown["depth (tokens, root to the node's end)"] == f"{int(row['depth_tokens']):,}"
    assert "subtree (tokens, the node and all below)" in shown and "idle (s, before the newest access)" in shown
    assert float(shown["idle (s, before the newest access)"]) >= 0


def test_page_hashes_show_as_short_hex(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "fleet.db"
    write_fleet(db)  # NOTE: run 1's node 1 holds tokens 1-4, two pages of 2 tokens
    at = tree_page(db, monkeypatch)
    at.selectbox(key="tree.node").set_value(1).run()
    blob = hashes_of([], [1, 2, 3, 4])
    assert fields(at)["page hashes (hex, first 4 bytes each)"] == f"2 pages: {blob[:4].hex()} {blob[8:12].hex()}"
    assert node_details.short_hashes(None) == "–"
    assert node_details.short_hashes(bytes(range(40))).endswith(" … (+2)")


def test_a_click_on_an_icicle_node_selects_it(monkeypatch: pytest.MonkeyPatch) -> None:
    at = tree_page(LEAKY, monkeypatch)
    first, clicked, other = (int(n) for n in at.selectbox(key="tree.node").options[:3])
    assert at.selectbox(key="tree.node").value == first
    click(at, clicked)
    assert at.selectbox(key="tree.node").value == clicked
    assert fields(at)["node"] == f"#{clicked}" and at.query_params["node"] in (str(clicked), [str(clicked)])
    at.selectbox(key="tree.node").set_value(other).run()  # the chart's selection stays set: the picker moves on
    assert at.selectbox(key="tree.node").value == other and fields(at)["node"] == f"#{other}"
    assert node_details.clicked_node({"selection": {"points": []}}) is None
    assert node_details.clicked_node({"selection": {"points": [{"id": "root"}]}}) is None
