"""Usage charts: pool terms over time, the live panel, hit rates, page waste.

NOTE: the four terms of a pool stack to its total:
    free        the allocator's available slots
    evictable   cached in the tree, unlocked (reclaimable)
    protected   cached in the tree, locked by a running request
    requests    held by running requests outside the tree: total - free - evictable - protected
                (at an idle leak check, anything here that no request holds is a leak)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.dashboard.charts.style import BOTTOM_MARGIN, color, count_axis, legend_above, run_axis

TERMS = ("requests", "protected", "evictable", "free")
TERM_NAMES = {"requests": "held by requests", "protected": "protected", "evictable": "evictable", "free": "free"}
POOL_TITLES = {"full": "full pool", "swa": "SWA pool"}


def pools_of(usage: pd.DataFrame) -> list[str]:
    """full, plus swa when the run has a sliding-window pool."""
    has_swa = "swa_total" in usage and usage["swa_total"].notna().any()
    return ["full", "swa"] if has_swa else ["full"]


def pool_terms(usage: pd.DataFrame, pool: str, x: str = "step") -> pd.DataFrame:
    """step (and the x column, when it is another), total and the four stacked terms of one pool, in tokens."""
    total = usage[f"{pool}_total"].astype(float)
    free = usage[f"{pool}_available"].astype(float)
    evictable = usage[f"{pool}_evictable"].astype(float)
    protected = usage[f"{pool}_protected"].astype(float)
    return pd.DataFrame(
        {
            "step": usage["step"],
            **({x: usage[x]} if x != "step" else {}),
            "total": total,
            "free": free,
            "evictable": evictable,
            "protected": protected,
            "requests": total - free - evictable - protected,
        }
    )


def memory_timeline_figure(usage: pd.DataFrame, x: str = "step") -> go.Figure:
    """One stacked area per pool, side by side on one shared axis: the steps, or (x = "time") the
    wall-clock time the page added to each row."""
    pools = pools_of(usage)
    fig = make_subplots(rows=1, cols=len(pools), shared_xaxes="all", subplot_titles=[POOL_TITLES[p] for p in pools])
    for col, pool in enumerate(pools, 1):
        terms = pool_terms(usage, pool, x)
        for term in TERMS:
            fig.add_trace(
                go.Scatter(
                    x=terms[x],
                    customdata=terms["step"],
                    hovertemplate="%{y:,} tokens (step %{customdata})",
                    y=terms[term],
                    name=TERM_NAMES[term],
                    stackgroup=pool,
                    mode="lines",
                    line={"width": 0.5, "color": color(term)},
                    fillcolor=color(term),
                    legendgroup=term,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
        fig.update_yaxes(count_axis(terms["total"], "tokens"), row=1, col=col)
        fig.update_xaxes(run_axis(terms, x), row=1, col=col)
    fig.update_layout(height=400, hovermode="x unified")
    return legend_above(fig, top_margin=80, y=1.1)


def live_usage_figure(usage: pd.DataFrame, x: str = "step") -> go.Figure:
    """Allocated fraction of each pool (total - free: "used" plus evictable), and running / waiting
    requests, over steps (or, x = "time", the wall-clock time the page added to each row)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for pool in pools_of(usage):
        terms = pool_terms(usage, pool)
        allocated = (terms["total"] - terms["free"]) / terms["total"].where(terms["total"] > 0)
        fig.add_trace(
            go.Scatter(
                x=usage[x],
                y=allocated,
                customdata=usage["step"],
                hovertemplate="%{y:.1%} (step %{customdata})",
                name=f"{pool} allocated",
                mode="lines",
                line={"color": color(pool)},
            )
        )
    for column in ("num_running", "num_waiting"):
        name = column.removeprefix("num_")
        fig.add_trace(
            go.Scatter(
                x=usage[x],
                y=usage[column],
                customdata=usage["step"],
                hovertemplate="%{y} (step %{customdata})",
                name=name,
                mode="lines",
                line={"dash": "dot", "color": color(name)},
            ),
            secondary_y=True,
        )
    counts = pd.concat([usage["num_running"], usage["num_waiting"]])
    fig.update_yaxes(title_text="allocated (total - free)", tickformat=".0%", range=[0, 1.05], secondary_y=False)
    fig.update_yaxes(count_axis(counts, "requests"), rangemode="tozero", showgrid=False, secondary_y=True)
    fig.update_xaxes(run_axis(usage, x))
    fig.update_layout(height=300, margin={"b": BOTTOM_MARGIN})
    return legend_above(fig)


class HitRates(NamedTuple):
    token_weighted: float | None  # cached prompt tokens / prompt tokens (ratio of sums)
    request_weighted: float | None  # requests with any hit / requests


def hit_rates(row: Any) -> HitRates:
    prompt, requests = float(row["cum_prompt_tokens"]), float(row["cum_requests"])
    return HitRates(
        float(row["cum_hit_tokens"]) / prompt if prompt else None,
        float(row["cum_hit_requests"]) / requests if requests else None,
    )


def page_waste_figure(waste: pd.DataFrame) -> go.Figure:
    """Tokens vs slots held per running request (whole pages); the gap is wasted slots."""
    waste = waste.sort_values("slots_held", ascending=False)
    fig = go.Figure(
        [
            go.Bar(x=waste["rid"], y=waste["seq_len"], name="tokens", marker_color=color("tokens")),
            go.Bar(
                x=waste["rid"],
                y=waste["wasted_slots"],
                name="wasted slots (last page)",
                marker_color=color("wasted slots"),
            ),
        ]
    )
    fig.update_layout(
        barmode="stack",
        height=320,
        margin={"b": BOTTOM_MARGIN},
        yaxis=count_axis(waste["slots_held"], "slots"),
        xaxis={"title": {"text": "running request"}, "type": "category"},
    )
    return legend_above(fig)
