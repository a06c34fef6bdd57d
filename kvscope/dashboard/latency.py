"""Request latency and throughput figures for the Requests page (pure: DataFrame in, Figure out).

NOTE: these series are new beside charts/style.COLORS; their colours are fixed here, by name,
so each keeps its colour on every capture.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.dashboard.charts.style import legend_above
from kvscope.dashboard.timing import LATENCIES, Clock

COLORS = {
    "queue": "#bcbd22",
    "time to first token": "#ff7f0e",
    "end to end": "#1f77b4",
    "hit rate so far": "#9467bd",
    "hit rate (window)": "#c5b0d5",
    "prompt tokens/s": "#8c564b",
    "cached tokens/s": "#2ca02c",
}
TIME_COLUMNS = {
    "arrive_t": "arrive",
    "admit_t": "admit",
    "first_token_t": "first token",
    "finish_t": "finish",
    "retract_t": "retract",
}


BOX_POINTS_MAX = 20_000  # NOTE: more requests: the box is computed here, drawn without its points


def latency_figure(latency_ms: pd.DataFrame) -> go.Figure:
    """One horizontal box per latency (ms): median, quartiles and outliers of the requests that
    reached that stage. Past BOX_POINTS_MAX requests the box is computed here (quartiles, and
    whiskers at the furthest values within 1.5 IQR, as plotly draws them) and drawn without its
    outliers: the browser gets five numbers, not every request."""
    fig = go.Figure()
    for name in reversed(list(LATENCIES)):
        values = latency_ms[name].dropna()
        if len(values) > BOX_POINTS_MAX:
            fig.add_trace(_box_of_many(values.to_numpy(dtype=float), name))
            continue
        fig.add_trace(
            go.Box(
                x=values,
                name=name,
                orientation="h",
                marker_color=COLORS[name],
                boxpoints="outliers",
                hovertemplate="%{x:,.1f} ms<extra>" + name + "</extra>",
                showlegend=False,
            )
        )
    fig.update_layout(
        height=260, margin={"t": 10, "b": 10}, xaxis={"title": {"text": "milliseconds"}, "rangemode": "tozero"}
    )
    return fig


def latency_box_figure(boxes: pd.DataFrame) -> go.Figure:
    """latency_figure's boxes from their five numbers (timing.histogram_percentiles: q1, median, q3,
    low, high per latency), drawn without points: the requests are not read."""
    fig = go.Figure()
    for row in reversed(list(boxes.itertuples(index=False))):
        if row.requests:
            fig.add_trace(_box(str(row.latency), row.q1, row.median, row.q3, row.low, row.high))
    fig.update_layout(
        height=260, margin={"t": 10, "b": 10}, xaxis={"title": {"text": "milliseconds"}, "rangemode": "tozero"}
    )
    return fig


def _box_of_many(values: np.ndarray, name: str) -> go.Box:
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    reach = 1.5 * (q3 - q1)
    return _box(name, q1, median, q3, values[values >= q1 - reach].min(), values[values <= q3 + reach].max())


def _box(name: str, q1: float, median: float, q3: float, low: float, high: float) -> go.Box:
    return go.Box(
        q1=[q1],
        median=[median],
        q3=[q3],
        lowerfence=[low],
        upperfence=[high],
        y=[name],
        name=name,
        orientation="h",
        marker_color=COLORS[name],
        boxpoints=False,
        showlegend=False,
    )


def throughput_figure(series: pd.DataFrame, with_clock: bool) -> go.Figure:
    """Token hit rate (so far and over a sliding window) above prompt and cached tokens per
    second, on one time axis (timing.throughput's frame)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    for name in ("hit rate so far", "hit rate (window)"):
        fig.add_trace(
            go.Scatter(
                x=series["time"],
                y=series[name],
                name=name,
                mode="lines",
                line={"color": COLORS[name], "dash": "solid" if name.endswith("far") else "dot"},
                customdata=series["step"],
                hovertemplate="step %{customdata}: %{y:.1%}",
            ),
            row=1,
            col=1,
        )
    for name in ("prompt tokens/s", "cached tokens/s"):
        fig.add_trace(
            go.Scatter(
                x=series["time"],
                y=series[name],
                name=name,
                mode="lines",
                line={"color": COLORS[name]},
                customdata=series["step"],
                hovertemplate="step %{customdata}: %{y:,.0f} tokens/s",
            ),
            row=2,
            col=1,
        )
    fig.update_yaxes(title_text="token hit rate", tickformat=".0%", range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="tokens / s", rangemode="tozero", tickformat=",d", row=2, col=1)
    fig.update_xaxes(title_text="wall-clock time" if with_clock else "seconds since the first sample", row=2, col=1)
    fig.update_layout(height=420, hovermode="x unified")
    return legend_above(fig)


def request_table(requests: pd.DataFrame, latency_ms: pd.DataFrame, clock: Clock | None) -> pd.DataFrame:
    """The requests with wall-clock times instead of monotonic seconds (seconds since the first
    arrival without a clock) and their three latencies in ms."""
    out = requests.drop(columns=["run_id"], errors="ignore").copy()
    origin = pd.to_numeric(out["arrive_t"], errors="coerce").min()
    for column, name in TIME_COLUMNS.items():
        if column not in out:
            continue
        t = pd.to_numeric(out.pop(column), errors="coerce").astype(float)
        out[name if clock is not None else f"{name} (s)"] = clock.datetimes(t) if clock is not None else t - origin
    for name in LATENCIES:
        out[f"{name} (ms)"] = latency_ms[name].round(1).to_numpy()
    first = [c for c in ("rid", "principal", "status") if c in out]
    added = [c for c in out.columns if c not in requests.columns]
    return out[first + added + [c for c in out.columns if c not in first and c not in added]]
