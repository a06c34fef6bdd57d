"""The look every chart shares: one colour per series name, integer ticks on count axes, the
legend above the plot.

NOTE: colours are keyed by what a series is (a pool, a pool term, a request phase or status, an
event kind), never by its position in a figure, so a series keeps its colour on every page and
on every capture (plotly's default colourway hands colours out in trace order, which moved
"running" from red to purple when a run had an SWA pool). A builder asks `color(name)`; an
unknown name is a KeyError, so a new series must be given its colour here.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import pandas as pd
import plotly.graph_objects as go

COLORS: dict[str, str] = {
    # pools
    "full": "#1f77b4",
    "swa": "#17becf",
    "req": "#7f7f7f",
    "host": "#e377c2",
    # the terms of a pool (usage samples and the idle leak invariant)
    "free": "#c7c7c7",
    "available": "#c7c7c7",
    "evictable": "#2ca02c",
    "protected": "#ff7f0e",
    "requests": "#9467bd",  # held by running requests outside the tree
    "held": "#9467bd",
    "uncached": "#8c564b",
    "missing": "#d62728",  # neither free, cached nor held: leaked
    "outside free list and tree": "#7f7f7f",
    "check failed": "#d62728",
    "onset": "#d62728",
    "first failed check": "#9467bd",
    # run and request statuses (runs.status, requests.status, display_status)
    "running": "#9467bd",
    "waiting": "#bcbd22",
    "finished": "#2ca02c",
    "interrupted": "#ff7f0e",
    "crashed": "#d62728",
    "incomplete": "#8c564b",
    "ended without closing": "#7f7f7f",
    "aborted": "#e377c2",
    "unfinished": "#bcbd22",
    "in_flight": "#17becf",
    # node visibility (scoped radix; global-sharing trees are all public) and tenant reuse
    "private": "#ff7f0e",
    "public": "#1f77b4",
    "pinned": "#2ca02c",
    "visibility not recorded": "#c7c7c7",
    "promote": "#2ca02c",
    "demote": "#d62728",
    # request phases
    "prefill": "#ff7f0e",
    "decode": "#1f77b4",
    "prefill chunk": "#000000",
    "retracted": "#d62728",
    "admitted (first token not recorded)": "#9edae5",
    "cached": "#2ca02c",
    "computed": "#c7c7c7",
    # evictions
    "evictions": "#1f77b4",
    "evicted tokens": "#aec7e8",
    "evicted, not needed again": "#1f77b4",
    "evicted, then needed again": "#d62728",
    # page waste
    "tokens": "#1f77b4",
    "wasted slots": "#d62728",
    # tree changes
    "new": "#2ca02c",
    "grew": "#98df8a",
    "shrank": "#ff9896",
    "evicted": "#d62728",
    # capacity
    "token hit rate": "#1f77b4",
    "token hit rate, global sharing": "#1f77b4",
    "token hit rate, per-principal isolation": "#9467bd",
    "target": "#7f7f7f",
    "needed": "#ff7f0e",
    "fits on the GPU": "#2ca02c",
    # tree colourings by category
    "tombstone": "#d62728",
    "live": "#aec7e8",
    "no owner": "#c7c7c7",
}
POOL_DASHES = {"full": "solid", "swa": "dash", "req": "dot", "host": "dashdot"}  # a pool's lines, where colour
POOL_SYMBOLS = {"full": "x", "swa": "cross", "req": "star", "host": "diamond"}  # is the term's
OWNER_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
)
SMALL_COUNT_SPAN = 10  # a count axis spanning at most this gets a tick at every integer
BOTTOM_MARGIN = 50  # room for the tick labels and the x axis title
LEGEND_ABOVE = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0.0}


def color(name: str) -> str:
    """The one colour of a series, by what it is (a KeyError names a series with none yet)."""
    return COLORS[name]


def owner_color(owner: str | None) -> str:
    """A tenant's colour: stable for the same owner name on every step and capture."""
    if owner is None or owner in ("", "-"):
        return COLORS["no owner"]
    return OWNER_PALETTE[zlib.crc32(owner.encode()) % len(OWNER_PALETTE)]


def count_axis(values: Iterable[Any] = (), title: str | None = None, from_zero: bool = True) -> dict[str, Any]:
    """Axis settings for a count (tokens, slots, requests, evictions): whole-number tick labels,
    and a tick at every integer when the axis spans little (plotly's automatic ticks would fall
    on 0.5). `from_zero`: the axis reaches down to 0 (bars, stacked areas), so 0 counts in its span."""
    numbers = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").dropna()
    low, high = (float(numbers.min()), float(numbers.max())) if len(numbers) else (0.0, 0.0)
    if from_zero:
        low, high = min(low, 0.0), max(high, 0.0)
    # NOTE: an explicit tickmode: plotly syncs an overlaying axis's ticks to the main axis's grid
    # by default, which puts a count's ticks on fractions (5.8, 11.6, ...) that ",d" then rounds
    axis: dict[str, Any] = {"tickformat": ",d", "tickmode": "auto"}
    if high - low <= SMALL_COUNT_SPAN:
        axis.update(tickmode="linear", tick0=0, dtick=1)
    if title is not None:
        axis["title"] = {"text": title}
    return axis


def step_axis(values: Iterable[Any] = (), title: str = "step") -> dict[str, Any]:
    """A count axis over the data's own span (steps start where the run's data starts).

    NOTE: a tick at every integer on a line's own range puts the first and last ticks on the
    plot's edges; with no tick between them (a run of one or two steps) plotly.js places the
    axis title at y = -Infinity (an SVG error in the browser's console). Half a step of room on
    each side keeps every tick inside the plot."""
    values = list(values)
    axis = count_axis(values, title, from_zero=False)
    numbers = pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").dropna()
    if axis["tickmode"] == "linear" and len(numbers):
        axis["range"] = [float(numbers.min()) - 0.5, float(numbers.max()) + 0.5]
    return axis


WALL_CLOCK = "time"  # NOTE: the column a page adds to usage rows for a wall-clock x axis (local datetimes)


def run_axis(frame: pd.DataFrame, x: str = "step") -> dict[str, Any]:
    """The x axis of a chart over a run: its steps, or (x = WALL_CLOCK) the wall-clock time of
    each row, to line the chart up with an incident's time; the hover names the step either way."""
    if x != WALL_CLOCK:
        return step_axis(frame["step"])
    return {
        "title": {"text": "wall-clock time"},
        "type": "date",
        "tickformat": "%H:%M:%S",
        "hoverformat": "%H:%M:%S.%L",
    }


def legend_above(fig: go.Figure, top_margin: int = 60, y: float = 1.02) -> go.Figure:
    """Put the legend in a row above the plot area (and above subplot titles, with a larger
    `y`), where it covers no data."""
    fig.update_layout(legend={**LEGEND_ABOVE, "y": y}, margin={"t": max(top_margin, fig.layout.margin.t or 0)})
    return fig
