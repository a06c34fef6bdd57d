"""A fleet's charts (kvscope/fleet/figures.py's frames): each replica's idle floor over time,
unique vs duplicated cached tokens over time, the routing loss per dispatch method."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvscope.dashboard.charts.style import COLORS, count_axis, legend_above

UNIQUE, DUPLICATED = "unique", "duplicated"
DUPLICATION_COLORS = {UNIQUE: COLORS["full"], DUPLICATED: COLORS["missing"]}


def idle_floor_figure(floors: pd.DataFrame) -> go.Figure:
    """One line per rank: tokens in use at each idle leak check (t_s: seconds since the fleet's first)."""
    fig = go.Figure()
    for rank, rows in floors.groupby("rank", sort=True):
        fig.add_trace(go.Scatter(x=rows["t_s"], y=rows["floor_tokens"], mode="lines+markers", name=f"rank {rank}"))
    fig.update_layout(
        xaxis_title="seconds", yaxis=count_axis(floors["floor_tokens"], "tokens in use at idle"), height=280
    )
    return legend_above(fig)


def duplication_figure(duplication: pd.DataFrame) -> go.Figure:
    """Unique and duplicated cached tokens, stacked (their sum is the replicas' held tokens)."""
    fig = go.Figure()
    for name, column in ((UNIQUE, "unique_tokens"), (DUPLICATED, "duplicated_tokens")):
        fig.add_trace(
            go.Scatter(
                x=duplication["t_s"],
                y=duplication[column],
                name=name,
                stackgroup="held",
                line={"color": DUPLICATION_COLORS[name]},
            )
        )
    held = duplication["unique_tokens"] + duplication["duplicated_tokens"]
    fig.update_layout(xaxis_title="seconds", yaxis=count_axis(held, "cached tokens (all replicas)"), height=280)
    return legend_above(fig)


def routing_figure(routing: pd.DataFrame) -> go.Figure:
    """The routing loss per dispatch method, as a share of its requests' prompt tokens."""
    fig = go.Figure(go.Bar(x=routing["dispatch"], y=routing["loss_share"], marker_color=COLORS["missing"]))
    fig.update_layout(yaxis_title="routing loss (share of prompt tokens)", yaxis_tickformat=".2~%", height=260)
    return fig
