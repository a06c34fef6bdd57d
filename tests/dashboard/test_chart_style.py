"""Every chart builder on frames read from every sample capture (real SQLite): one colour per
series name everywhere, series in one figure told apart, legends above the plot, whole-number
ticks on count axes; the tree's categorical legends and its colour scale without the root."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from kvscope import telemetry
from kvscope.dashboard import charts, data
from kvscope.planning import load_requests, one_pass_curve
from kvscope.telemetry import Capture
from tests.dashboard.conftest import SAMPLES
from tests.dashboard.test_charts import NODES, usage_frame

COUNT_TITLES = {
    "step",
    "tokens",
    "slots",
    "requests",
    "evictions",
    "prompt tokens",
    "token change",
    "node age at eviction (steps)",
    "idle before eviction (steps)",
    "cache capacity (tokens)",
}


@cache
def figures_of(path: Path) -> dict[str, go.Figure]:
    capture = Capture(path)
    run_id = int(capture.latest_run_id() or 1)
    usage = capture.usage(run_id, data.MAX_POINTS)
    requests = capture.requests(run_id)
    last = int(usage["step"].max())
    busiest = int(usage.loc[usage["num_running"].astype(int).idxmax(), "step"])
    nodes = charts.subtree_values(capture.tree_at(run_id, last))
    curve = one_pass_curve(load_requests(str(path), run_id), 1)
    curve_frame = charts.curve_frame(*curve.breakpoints(), curve.num_prompt_tokens)
    return {
        "memory": charts.memory_timeline_figure(usage),
        "live": charts.live_usage_figure(usage),
        "leaks": charts.leak_terms_figure(capture.leak_checks(run_id), usage, None, None),
        "evictions": charts.evictions_figure(telemetry.evictions_over_steps(capture, run_id, data.MAX_POINTS)),
        "idle": charts.eviction_idle_figure(telemetry.eviction_log(capture, run_id, 200, 0)),
        "timeline": charts.request_timeline_figure(
            requests, telemetry.allocs_of_requests(capture, run_id, tuple(requests["rid"]))
        ),
        "cached": charts.cached_tokens_figure(requests),
        "waste": charts.page_waste_figure(data.page_waste(telemetry.running_lengths(capture, run_id, busiest), 4)),
        "owner": charts.tree_figure(nodes, "owner"),
        "tombstone": charts.tree_figure(nodes, "tombstone"),
        "diff": charts.tree_diff_figure(
            charts.tree_diff(capture.tree_at(run_id, last // 2), capture.tree_at(run_id, last))
        ),
        "capacity": charts.capacity_figure(curve_frame, 0.5, charts.capacity_for(curve_frame, 0.5), 10**6),
    }


def style(trace: Any) -> tuple[Any, ...]:
    """(colour, dash, symbol) of a bar or scatter trace; per-bar colours as a tuple."""
    if trace.type == "bar":
        colour = trace.marker.color
        return (tuple(colour) if isinstance(colour, list | tuple) else colour, None, None)
    lines = "lines" in (trace.mode or "")
    return (trace.line.color if lines else trace.marker.color, trace.line.dash if lines else None, trace.marker.symbol)


def series(fig: go.Figure) -> list[Any]:
    return [t for t in fig.data if t.type in ("bar", "scatter")]


def every_figure() -> list[tuple[str, go.Figure]]:
    return [(f"{path.stem}:{name}", fig) for path in SAMPLES for name, fig in figures_of(path).items()]


def test_every_series_has_one_colour_on_every_page_and_capture() -> None:
    seen: dict[str, set[Any]] = {}
    for _, fig in every_figure():
        for trace in series(fig):
            seen.setdefault(trace.name, set()).add(style(trace)[0])
    assert seen, "no series drawn"
    assert {name: colours for name, colours in seen.items() if len(colours) != 1 or None in colours} == {}


def test_series_in_one_figure_are_told_apart() -> None:
    for where, fig in every_figure():
        shown = [t for t in series(fig) if t.showlegend is not False and t.name]
        styles = {t.name: style(t) for t in shown}
        assert len(set(styles.values())) == len(styles), (where, styles)


def test_every_legend_sits_above_the_plot() -> None:
    for where, fig in every_figure():
        if len([t for t in series(fig) if t.showlegend is not False and t.name]) < 2:
            continue
        legend = fig.layout.legend
        assert legend.orientation == "h" and legend.y >= 1 and legend.yanchor == "bottom", where


def count_axes(fig: go.Figure) -> list[tuple[str, Any]]:
    layout = fig.to_dict()["layout"]
    return [
        (key, axis)
        for key, axis in layout.items()
        if key.startswith(("xaxis", "yaxis")) and axis.get("title", {}).get("text") in COUNT_TITLES
    ]


def test_count_axes_tick_on_whole_numbers() -> None:
    found = 0
    for where, fig in every_figure():
        for key, axis in count_axes(fig):
            found += 1
            assert axis.get("tickformat") == ",d", (where, key)
    assert found > 30


def test_small_counts_get_a_tick_at_every_integer_large_ones_keep_automatic_ticks() -> None:
    per_step = pd.DataFrame({"step": [3, 4], "num_evictions": [1, 3], "evicted_tokens": [500, 9000]})
    layout = charts.evictions_figure(per_step).layout
    assert layout.yaxis2.dtick == 1 and layout.yaxis2.tickformat == ",d"  # 1 to 3 evictions: no 0.5, 1.5 ticks
    assert layout.xaxis.dtick == 1
    assert layout.yaxis.dtick is None and layout.yaxis.tickformat == ",d"
    live = charts.live_usage_figure(usage_frame(swa=False)).layout
    assert live.yaxis2.dtick == 1 and live.yaxis2.title.text == "requests"


def test_a_short_runs_step_ticks_sit_inside_the_plot() -> None:
    """Ticks at every step on a line's own range put the first and last on the plot's edges, and with
    none between them (two steps) plotly.js puts the axis title at y = -Infinity (a console error in
    the browser: tests/dashboard/test_browser.py sees it). Half a step of room on each side."""
    two_steps = usage_frame(swa=False).head(2)
    steps = two_steps["step"].astype(float)
    for fig in (charts.memory_timeline_figure(two_steps), charts.live_usage_figure(two_steps)):
        assert list(fig.layout.xaxis.range) == [steps.min() - 0.5, steps.max() + 0.5]
    assert "range" not in charts.style.step_axis(range(0, 500))  # automatic ticks: plotly's own range
    assert "range" not in charts.style.step_axis([float("nan")])  # no step known: nothing to pad


def test_running_keeps_its_colour_with_or_without_an_swa_pool() -> None:
    def running(fig: go.Figure) -> str:
        return next(t.line.color for t in fig.data if t.name == "running")

    assert (
        running(charts.live_usage_figure(usage_frame(swa=False)))
        == running(charts.live_usage_figure(usage_frame(swa=True)))
        == charts.COLORS["running"]
    )


def test_a_pools_leak_terms_share_the_terms_colours_and_differ_by_dash() -> None:
    checks = pd.DataFrame(
        {
            "step": [5, 5],
            "pool": ["full", "swa"],
            "total": [100, 80],
            "available": [100, 80],
            "evictable": [0, 0],
            "protected": [0, 0],
            "held": [0, 0],
            "uncached": [0, 0],
            "ok": [True, True],
        }
    )
    fig = charts.leak_terms_figure(checks, usage_frame(swa=True), None, None)
    full, swa = (next(t for t in fig.data if t.name == f"{pool}: evictable") for pool in ("full", "swa"))
    assert full.line.color == swa.line.color == charts.COLORS["evictable"]
    assert full.line.dash != swa.line.dash


def test_the_roots_permanent_lock_does_not_set_the_lock_colour_scale() -> None:
    nodes = NODES.assign(lock_ref=[7, 2, 0, 1, 0])  # the root: 7
    marker = charts.tree_figure(charts.subtree_values(nodes), "lock_ref").data[0].marker
    assert (marker.cmin, marker.cmax) == (0, 2)
    assert marker.colors[0] == 0  # the root takes the low end
    idle = NODES.assign(lock_ref=[1, 0, 0, 0, 0])  # at idle only the root is locked
    marker = charts.tree_figure(charts.subtree_values(idle), "lock_ref").data[0].marker
    assert marker.cmax == 1 and list(marker.colors) == [0, 0, 0, 0, 0]


def legend_names(fig: go.Figure) -> list[str]:
    return [t.name for t in fig.data if t.type == "scatter"]


def test_categorical_colourings_have_a_legend() -> None:
    nodes = charts.subtree_values(NODES)
    owners = legend_names(charts.tree_figure(nodes, "owner"))
    # NOTE: the root is no node of the legend (nor of the captions): 4 nodes below it
    assert sorted(owners) == ["no owner (1 node)", "owner u0 (2 nodes)", "owner u1 (1 node)"]
    assert sorted(legend_names(charts.tree_figure(nodes, "tombstone"))) == ["live (3 nodes)", "tombstone (1 node)"]
    assert legend_names(charts.tree_figure(nodes, "lock_ref")) == []  # a numeric colouring has its colour bar
    for name, fig in figures_of(SAMPLES[0]).items():  # hybrid-swa: tenants and SWA tombstones
        if name in ("owner", "tombstone"):
            assert legend_names(fig), name


def test_an_owner_keeps_its_colour_whatever_other_owners_exist() -> None:
    def colour_of_u1(nodes: pd.DataFrame) -> str:
        fig = charts.tree_figure(charts.subtree_values(nodes), "owner")
        return fig.data[0].marker.colors[list(nodes["node_id"]).index(3)]

    assert colour_of_u1(NODES) == colour_of_u1(NODES.assign(owner=[None, None, None, "u1", None]))


def test_capacity_axis_spans_the_working_set_and_names_a_gpu_beyond_it() -> None:
    curve = charts.curve_frame(np.array([10, 40, 90]), np.array([20, 50, 60]), prompt_tokens=100)
    far = charts.capacity_figure(curve, 0.5, 40, gpu_tokens=1_000_000)
    assert far.layout.xaxis.range[1] == pytest.approx(99)  # the working set (90) and a margin
    assert "1,000,000" in far.layout.annotations[-1].text
    near = charts.capacity_figure(curve, 0.5, 40, gpu_tokens=60)
    assert 60 in {shape.x0 for shape in near.layout.shapes}
