"""Charts over events: evictions, the leak invariant, request lifetimes."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvscope.dashboard.charts.style import (
    BOTTOM_MARGIN,
    POOL_DASHES,
    POOL_SYMBOLS,
    color,
    count_axis,
    legend_above,
    step_axis,
)

LEAK_TERMS = ("available", "evictable", "protected", "held", "uncached")
PHASES = (
    ("waiting", "arrive_step", "admit_step"),
    ("prefill", "admit_step", "first_token_step"),
    ("decode", "first_token_step", "finish_step"),
)


def evictions_figure(per_step: pd.DataFrame) -> go.Figure:
    """Evicted tokens per step (bars) and evictions per step (line)."""
    fig = go.Figure(
        [
            go.Bar(
                x=per_step["step"],
                y=per_step["evicted_tokens"],
                name="evicted tokens",
                marker_color=color("evicted tokens"),
            ),
            go.Scatter(
                x=per_step["step"],
                y=per_step["num_evictions"],
                name="evictions",
                yaxis="y2",
                mode="lines+markers",
                line={"color": color("evictions")},
            ),
        ]
    )
    fig.update_layout(
        height=300,
        margin={"b": BOTTOM_MARGIN},
        xaxis=step_axis(per_step["step"]),
        yaxis=count_axis(per_step["evicted_tokens"], "tokens"),
        yaxis2={
            **count_axis(per_step["num_evictions"], "evictions"),
            "overlaying": "y",
            "side": "right",
            "rangemode": "tozero",
            "showgrid": False,
        },
    )
    return legend_above(fig)


def eviction_idle_figure(log: pd.DataFrame) -> go.Figure:
    """Node age and idle time at eviction, in steps; regretted evictions highlighted."""
    regret = log["regret_tokens"] > 0
    fig = go.Figure()
    for mask, name in ((~regret, "evicted, not needed again"), (regret, "evicted, then needed again")):
        part = log[mask]
        fig.add_trace(
            go.Scatter(
                x=part["age_steps"],
                y=part["idle_steps"],
                mode="markers",
                name=name,
                marker={
                    "color": color(name),
                    "size": (5 + part["evicted_tokens"].astype(float).clip(0, 200) / 20).tolist(),
                },
                text=part["node_id"].astype(str),
                hovertemplate="node %{text}<br>age %{x} steps<br>idle %{y} steps<extra></extra>",
            )
        )
    fig.update_layout(
        height=340,
        margin={"b": BOTTOM_MARGIN},
        xaxis=step_axis(log["age_steps"], "node age at eviction (steps)"),
        yaxis=step_axis(log["idle_steps"], "idle before eviction (steps)"),
    )
    return legend_above(fig)


def leak_terms_figure(
    checks: pd.DataFrame, usage: pd.DataFrame, onset_step: int | None, first_failure_step: int | None
) -> go.Figure:
    """The idle leak-check terms per pool (colour: the term, dash: the pool), the usage series'
    unaccounted slots, the onset marked."""
    fig = go.Figure()
    for pool, part in checks.groupby("pool"):
        dash = POOL_DASHES.get(str(pool), "solid")
        for term in LEAK_TERMS:
            fig.add_trace(
                go.Scatter(
                    x=part["step"],
                    y=part[term],
                    name=f"{pool}: {term}",
                    mode="lines+markers",
                    line={"color": color(term), "dash": dash},
                    legendgroup=str(pool),
                )
            )
        bad = part[~part["ok"].astype(bool)]
        fig.add_trace(
            go.Scatter(
                x=bad["step"],
                y=bad["total"],
                name=f"{pool}: check failed",
                mode="markers",
                marker={"symbol": POOL_SYMBOLS.get(str(pool), "x"), "size": 12, "color": color("check failed")},
                legendgroup=str(pool),
            )
        )
    if not usage.empty:
        outside = usage["full_total"] - usage["full_available"] - usage["full_evictable"] - usage["full_protected"]
        fig.add_trace(
            go.Scatter(
                x=usage["step"],
                y=outside,
                name="full: outside free list and tree (per step)",
                mode="lines",
                line={"dash": "dot", "color": color("outside free list and tree")},
            )
        )
    for step, label in ((onset_step, "onset"), (first_failure_step, "first failed check")):
        if step is not None:
            fig.add_vline(x=step, line_dash="dash", line_color=color(label), annotation_text=f"{label} (step {step})")
    fig.update_layout(
        height=400,
        margin={"b": BOTTOM_MARGIN},
        xaxis=step_axis(_trace_values(fig, "x")),
        yaxis=count_axis(_trace_values(fig, "y"), "slots"),
    )
    return legend_above(fig)


def _trace_values(fig: go.Figure, axis: str) -> list[float]:
    return [v for trace in fig.data if getattr(trace, axis) is not None for v in getattr(trace, axis)]


UNTIMED_PHASE = "admitted (first token not recorded)"


def _phase_bar(rows: pd.DataFrame, name: str, start: str, end: str) -> go.Bar:
    lo, hi = rows[start].astype(float), rows[end].astype(float)
    return go.Bar(
        y=rows["rid"],
        x=(hi - lo).clip(lower=0.5),
        base=lo,
        orientation="h",
        name=name,
        marker_color=color(name),
        hovertemplate=f"%{{y}} {name}: step %{{base}}–%{{x}}<extra></extra>",
    )


def _moments(rows: pd.DataFrame, kind: str, name: str, symbol: str) -> go.Scatter:
    return go.Scatter(
        y=rows["rid"],
        x=rows[f"{kind}_step"],
        mode="markers",
        name=name,
        marker={"symbol": symbol, "size": 10, "color": color(name)},
        hovertemplate=f"%{{y}}: {kind} at step %{{x}}<extra></extra>",
    )


def request_timeline_figure(requests: pd.DataFrame, allocs: pd.DataFrame) -> go.Figure:
    """One row per request: waiting, prefill, decode bars; prefill chunks as dots, retractions as
    crosses. What a source does not record is not drawn: without a first token (the vLLM probe), an
    admitted request is one bar from admit to finish; a request known only by its finish (the SGLang
    probe) is a mark at its finish step."""
    rows = requests.reset_index(drop=True)
    steps = [c for _, *moments in PHASES for c in moments] + ["retract_step"]
    rows = rows.assign(
        **{c: pd.to_numeric(rows[c], errors="coerce").astype(float) if c in rows else float("nan") for c in steps}
    )
    fig = go.Figure()
    for name, start, end in PHASES:
        fig.add_trace(_phase_bar(rows, name, start, end))
    untimed = rows[rows["first_token_step"].isna() & rows["admit_step"].notna() & rows["finish_step"].notna()]
    if not untimed.empty:
        fig.add_trace(_phase_bar(untimed, UNTIMED_PHASE, "admit_step", "finish_step"))
    only_finish = rows[rows["admit_step"].isna() & rows["first_token_step"].isna() & rows["finish_step"].notna()]
    if not only_finish.empty:
        fig.add_trace(_moments(only_finish, "finish", "finished", "circle"))
    if not allocs.empty:
        admitted = rows.set_index("rid")[["admit_step", "first_token_step"]].astype(float)  # NOTE: unknown: NaN
        chunks = allocs.join(admitted, on="rid")
        prefill = chunks["first_token_step"].isna() | (chunks["step"] <= chunks["first_token_step"])  # NOTE: NaN: in
        chunks = chunks[(chunks["step"] >= chunks["admit_step"]) & prefill]  # prefill when the run stopped
        fig.add_trace(
            go.Scatter(
                y=chunks["rid"],
                x=chunks["step"],
                mode="markers",
                name="prefill chunk",
                marker={"color": color("prefill chunk"), "size": 6},
                text=chunks["tokens"],
                hovertemplate="%{y}: chunk of %{text} tokens at step %{x}<extra></extra>",
            )
        )
    fig.add_trace(_moments(rows[rows["retract_step"].notna()], "retract", "retracted", "x"))
    fig.update_layout(
        barmode="overlay",
        height=max(320, 18 * len(rows) + 100),
        margin={"b": BOTTOM_MARGIN},
        xaxis=step_axis(rows[steps].to_numpy().ravel()),
        yaxis={"autorange": "reversed", "type": "category"},
    )
    return legend_above(fig)


def cached_tokens_figure(requests: pd.DataFrame) -> go.Figure:
    """Prompt tokens per request split into cached (prefix hit) and computed."""
    computed = requests["prompt_len"] - requests["cached_tokens"]
    fig = go.Figure(
        [
            go.Bar(x=requests["rid"], y=requests["cached_tokens"], name="cached", marker_color=color("cached")),
            go.Bar(x=requests["rid"], y=computed, name="computed", marker_color=color("computed")),
        ]
    )
    fig.update_layout(
        barmode="stack",
        height=320,
        margin={"b": BOTTOM_MARGIN},
        yaxis=count_axis(requests["prompt_len"], "prompt tokens"),
        xaxis={"type": "category", "showticklabels": len(requests) <= 60},
    )
    return legend_above(fig)
