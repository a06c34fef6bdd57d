"""Charts of cache sharing between tenants: tokens per tenant by visibility, and promotions
and demotions over steps."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvscope.dashboard.charts.style import BOTTOM_MARGIN, color, count_axis, legend_above, step_axis

VISIBILITY_SERIES = ("private", "public", "pinned", "visibility not recorded")
CHANGE_KINDS = ("promote", "demote")


def cache_by_tenant_figure(table: pd.DataFrame) -> go.Figure:
    """Stacked bars: per tenant, the tokens it owns in the cache by visibility (from
    tenants.cache_by_tenant)."""
    tenants = sorted(set(table["tenant"]))
    fig = go.Figure()
    for visibility in VISIBILITY_SERIES:
        rows = table[table["visibility"] == visibility].set_index("tenant")["num_tokens"]
        if rows.empty:
            continue
        fig.add_trace(
            go.Bar(x=tenants, y=[int(rows.get(t, 0)) for t in tenants], name=visibility, marker_color=color(visibility))
        )
    totals = table.groupby("tenant")["num_tokens"].sum()
    fig.update_layout(
        barmode="stack",
        height=300,
        margin={"b": BOTTOM_MARGIN},
        xaxis={"title": {"text": "tenant (of the node's owner)"}, "type": "category"},
        yaxis=count_axis(totals, "tokens in the cache"),
    )
    return legend_above(fig)


def visibility_changes_figure(changes: pd.DataFrame) -> go.Figure:
    """Tokens promoted (up) and demoted (down) per step (from telemetry.visibility_changes)."""
    fig = go.Figure()
    for kind in CHANGE_KINDS:
        rows = changes[changes["kind"] == kind]
        sign = 1 if kind == "promote" else -1
        fig.add_trace(
            go.Bar(
                x=rows["step"],
                y=sign * rows["num_tokens"].astype(int),
                name=f"{kind}d tokens",
                marker_color=color(kind),
                customdata=rows["num_events"],
                hovertemplate="step %{x}: %{y} tokens in %{customdata} node(s)<extra></extra>",
            )
        )
    signed = changes["num_tokens"].astype(int).where(changes["kind"] == "promote", -changes["num_tokens"].astype(int))
    fig.update_layout(
        barmode="relative",
        height=280,
        margin={"b": BOTTOM_MARGIN},
        xaxis=step_axis(changes["step"]),
        yaxis=count_axis(signed, "tokens (demoted below 0)", from_zero=True),
    )
    return legend_above(fig)
