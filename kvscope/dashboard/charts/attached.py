"""Charts of an attached capture (`kvscope attach`): the engine's own counters over the scrapes.
A series the source does not provide (all NULL) is left out, never drawn as zero."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvscope.dashboard.charts.style import BOTTOM_MARGIN, color, count_axis, legend_above, run_axis, step_axis


def _known(series: pd.Series) -> bool:
    return bool(pd.to_numeric(series, errors="coerce").notna().any())


def device_tokens_figure(usage: pd.DataFrame, used: pd.Series, x: str = "step") -> go.Figure:
    """Device tokens over the scrapes: used (solid), and free (available) and evictable
    (cached, reclaimable) when the source splits its pool; the capacity dotted. The x axis: the
    steps, or (x = "time") the wall-clock time the page added to each row."""
    steps = usage["step"].astype(int)
    fig = go.Figure()
    series = [("used", used, color("full"), "solid")]
    for column, name in (("full_available", "available"), ("full_evictable", "evictable")):
        if column in usage and _known(usage[column]):
            series.append((name, pd.to_numeric(usage[column], errors="coerce"), color(name), "solid"))
    capacity = pd.to_numeric(usage["full_total"], errors="coerce")
    series.append(("capacity", capacity.where(capacity > 0), color("full"), "dot"))  # NOTE: 0 = not known
    for name, values, line_color, dash in series:
        if _known(values):
            fig.add_trace(
                go.Scatter(
                    x=usage[x],
                    y=values,
                    customdata=steps,
                    hovertemplate="%{y:,} tokens (step %{customdata})",
                    name=name,
                    mode="lines",
                    line={"color": line_color, "dash": dash},
                )
            )
    values = pd.concat([s for _, s, _, _ in series])
    fig.update_layout(
        height=340,
        hovermode="x unified",
        margin={"b": BOTTOM_MARGIN},
        yaxis=count_axis(values, "tokens"),
        xaxis=run_axis(usage, x),
    )
    return legend_above(fig)


def host_tokens_figure(usage: pd.DataFrame, device_used: pd.Series) -> go.Figure:
    """Used tokens of the device and the host tier (solid) against each total (dotted)."""
    steps = usage["step"].astype(int)
    host_total = pd.to_numeric(usage["host_total"], errors="coerce")
    host_used = host_total - pd.to_numeric(usage["host_available"], errors="coerce")
    device_total = pd.to_numeric(usage["full_total"], errors="coerce")
    fig = go.Figure()
    for name, values, pool, dash in (
        ("device used", device_used, "full", "solid"),
        ("device total", device_total, "full", "dot"),
        ("host used", host_used, "host", "solid"),
        ("host total", host_total, "host", "dot"),
    ):
        if _known(values):
            fig.add_trace(
                go.Scatter(x=steps, y=values, name=name, mode="lines", line={"color": color(pool), "dash": dash})
            )
    fig.update_layout(
        height=340,
        hovermode="x unified",
        margin={"b": BOTTOM_MARGIN},
        yaxis=count_axis(pd.concat([device_used, device_total, host_used, host_total]), "tokens"),
        xaxis=step_axis(steps),
    )
    return legend_above(fig)


def request_counts_figure(usage: pd.DataFrame) -> go.Figure:
    """Running and waiting requests as the engine reports them, over the scrapes."""
    steps = usage["step"].astype(int)
    fig = go.Figure()
    for column in ("num_running", "num_waiting"):
        name = column.removeprefix("num_")
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=pd.to_numeric(usage[column], errors="coerce"),
                name=name,
                mode="lines",
                line={"color": color(name), "shape": "hv"},
            )
        )
    counts = pd.concat([usage["num_running"], usage["num_waiting"]])
    fig.update_layout(
        height=300,
        hovermode="x unified",
        margin={"b": BOTTOM_MARGIN},
        yaxis=count_axis(counts, "requests"),
        xaxis=step_axis(steps),
    )
    return legend_above(fig)


def hit_rate_figure(usage: pd.DataFrame) -> go.Figure:
    """The token hit rate of the engine's counters so far (cached / prompt tokens), per scrape."""
    steps = usage["step"].astype(int)
    prompts = pd.to_numeric(usage["cum_prompt_tokens"], errors="coerce")
    rate = pd.to_numeric(usage["cum_hit_tokens"], errors="coerce") / prompts.where(prompts > 0)
    fig = go.Figure(
        go.Scatter(x=steps, y=rate, name="token hit rate", mode="lines", line={"color": color("token hit rate")})
    )
    fig.update_layout(
        height=280,
        margin={"t": 20, "b": BOTTOM_MARGIN},
        showlegend=False,
        yaxis={"title": {"text": "token hit rate"}, "tickformat": ".0%", "range": [0, 1.05]},
        xaxis=step_axis(steps),
    )
    return fig
