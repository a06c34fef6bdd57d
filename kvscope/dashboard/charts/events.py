"""Charts over events: evictions, the leak invariant, request lifetimes."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

LEAK_TERMS = ("available", "evictable", "protected", "held", "uncached")
PHASES = (("waiting", "arrive_step", "admit_step", "#c7c7c7"), ("prefill", "admit_step", "first_token_step", "#ff7f0e"),
          ("decode", "first_token_step", "finish_step", "#1f77b4"))


def evictions_figure(per_step: pd.DataFrame) -> go.Figure:
    """Evicted tokens per step (bars) and evictions per step (line)."""
    fig = go.Figure([
        go.Bar(x=per_step["step"], y=per_step["evicted_tokens"], name="evicted tokens"),
        go.Scatter(x=per_step["step"], y=per_step["num_evictions"], name="evictions", yaxis="y2", mode="lines+markers"),
    ])
    fig.update_layout(height=280, margin={"t": 20, "b": 10}, xaxis_title="step", yaxis_title="tokens",
                      yaxis2={"title": "evictions", "overlaying": "y", "side": "right"})
    return fig


def eviction_idle_figure(log: pd.DataFrame) -> go.Figure:
    """Node age and idle time at eviction, in steps; regretted evictions highlighted."""
    regret = log["regret_tokens"] > 0
    fig = go.Figure()
    for mask, name, color in ((~regret, "evicted, not needed again", "#1f77b4"),
                              (regret, "evicted, then needed again", "#d62728")):
        part = log[mask]
        fig.add_trace(go.Scatter(x=part["age_steps"], y=part["idle_steps"], mode="markers", name=name,
                                 marker={"color": color, "size": 5 + part["evicted_tokens"].clip(0, 200) / 20},
                                 text=part["node_id"].astype(str), hovertemplate="node %{text}<br>age %{x} steps"
                                 "<br>idle %{y} steps<extra></extra>"))
    fig.update_layout(height=320, margin={"t": 20, "b": 10}, xaxis_title="node age at eviction (steps)",
                      yaxis_title="idle before eviction (steps)")
    return fig


def leak_terms_figure(checks: pd.DataFrame, usage: pd.DataFrame, onset_step: int | None,
                      first_failure_step: int | None) -> go.Figure:
    """The idle leak-check terms per pool, the usage series' unaccounted slots, the onset marked."""
    fig = go.Figure()
    for pool, part in checks.groupby("pool"):
        for term in LEAK_TERMS:
            fig.add_trace(go.Scatter(x=part["step"], y=part[term], name=f"{pool}: {term}", mode="lines+markers",
                                     legendgroup=str(pool)))
        bad = part[~part["ok"].astype(bool)]
        fig.add_trace(go.Scatter(x=bad["step"], y=bad["total"], name=f"{pool}: check failed", mode="markers",
                                 marker={"symbol": "x", "size": 12, "color": "#d62728"}, legendgroup=str(pool)))
    if not usage.empty:
        outside = usage["full_total"] - usage["full_available"] - usage["full_evictable"] - usage["full_protected"]
        fig.add_trace(go.Scatter(x=usage["step"], y=outside, name="full: outside free list and tree (per step)",
                                 mode="lines", line={"dash": "dot", "color": "#7f7f7f"}))
    for step, label, color in ((onset_step, "onset", "#d62728"), (first_failure_step, "first failed check", "#9467bd")):
        if step is not None:
            fig.add_vline(x=step, line_dash="dash", line_color=color, annotation_text=f"{label} (step {step})")
    fig.update_layout(height=380, margin={"t": 30, "b": 10}, xaxis_title="step", yaxis_title="slots")
    return fig


def request_timeline_figure(requests: pd.DataFrame, allocs: pd.DataFrame) -> go.Figure:
    """One row per request: waiting, prefill, decode bars; prefill chunks as dots, retractions as crosses."""
    rows = requests.reset_index(drop=True)
    fig = go.Figure()
    for name, start, end, color in PHASES:
        lo, hi = rows[start].astype(float), rows[end].astype(float)
        fig.add_trace(go.Bar(y=rows["rid"], x=(hi - lo).clip(lower=0.5), base=lo, orientation="h", name=name,
                             marker_color=color, hovertemplate=f"%{{y}} {name}: step %{{base}}–%{{x}}<extra></extra>"))
    if not allocs.empty:
        admitted = rows.set_index("rid")[["admit_step", "first_token_step"]]
        chunks = allocs.join(admitted, on="rid")
        chunks = chunks[(chunks["step"] >= chunks["admit_step"]) & (chunks["step"] <= chunks["first_token_step"])]
        fig.add_trace(go.Scatter(y=chunks["rid"], x=chunks["step"], mode="markers", name="prefill chunk",
                                 marker={"color": "#000000", "size": 6}, text=chunks["tokens"],
                                 hovertemplate="%{y}: chunk of %{text} tokens at step %{x}<extra></extra>"))
    retracted = rows[rows["retract_step"].notna()]
    fig.add_trace(go.Scatter(y=retracted["rid"], x=retracted["retract_step"], mode="markers", name="retracted",
                             marker={"symbol": "x", "size": 10, "color": "#d62728"}))
    fig.update_layout(barmode="overlay", height=max(300, 18 * len(rows) + 80), margin={"t": 20, "b": 10},
                      xaxis_title="step", yaxis={"autorange": "reversed", "type": "category"})
    return fig


def cached_tokens_figure(requests: pd.DataFrame) -> go.Figure:
    """Prompt tokens per request split into cached (prefix hit) and computed."""
    computed = requests["prompt_len"] - requests["cached_tokens"]
    fig = go.Figure([
        go.Bar(x=requests["rid"], y=requests["cached_tokens"], name="cached", marker_color="#2ca02c"),
        go.Bar(x=requests["rid"], y=computed, name="computed", marker_color="#c7c7c7"),
    ])
    fig.update_layout(barmode="stack", height=300, margin={"t": 20, "b": 10}, yaxis_title="prompt tokens",
                      xaxis={"type": "category", "showticklabels": len(requests) <= 60})
    return fig
