"""Hit rate vs cache capacity: the one-pass curve as a figure, and the capacity a target needs."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from kvscope.dashboard.charts.style import BOTTOM_MARGIN, color, count_axis, legend_above


def curve_frame(capacities: np.ndarray, hit_tokens: np.ndarray, prompt_tokens: int) -> pd.DataFrame:
    """The curve's breakpoints as (capacity_tokens, hit_rate), a step function from zero."""
    rate = hit_tokens / max(prompt_tokens, 1)
    return pd.DataFrame(
        {"capacity_tokens": np.concatenate(([0], capacities)), "hit_rate": np.concatenate(([0.0], rate))}
    )


def capacity_for(curve: pd.DataFrame, target_rate: float) -> int | None:
    """The smallest capacity whose hit rate reaches the target, or None if none does."""
    reached = curve[curve["hit_rate"] >= target_rate - 1e-12]
    return None if reached.empty else int(reached["capacity_tokens"].iloc[0])


def working_set_tokens(curve: pd.DataFrame) -> int:
    """The capacity past which the hit rate grows no more: the curve's last breakpoint."""
    return int(curve["capacity_tokens"].max()) if not curve.empty else 0


def capacity_figure(
    curve: pd.DataFrame,
    target_rate: float,
    needed_tokens: int | None,
    gpu_tokens: int | None = None,
    *,
    name: str = "token hit rate",
    others: Mapping[str, pd.DataFrame] | None = None,
) -> go.Figure:
    """The curve (the target is read on it), and any `others` by name, dotted, on an axis scaled to
    the widest working set (a GPU's capacity is usually far beyond it: then it is named at the
    right edge rather than stretching the axis to it)."""
    others = others or {}
    working_set = max(working_set_tokens(c) for c in (curve, *others.values()))
    x_max = max(working_set, needed_tokens or 0, 1) * 1.1
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=curve["capacity_tokens"],
            y=curve["hit_rate"],
            mode="lines",
            line_shape="hv",
            name=name,
            line={"color": color(name)},
        )
    )
    for other_name, other in others.items():
        fig.add_trace(
            go.Scatter(
                x=other["capacity_tokens"],
                y=other["hit_rate"],
                mode="lines",
                line_shape="hv",
                name=other_name,
                line={"color": color(other_name), "dash": "dot"},
            )
        )
    fig.add_hline(
        y=target_rate, line_dash="dot", line_color=color("target"), annotation_text=f"target {target_rate:.0%}"
    )
    if needed_tokens is not None:
        fig.add_vline(
            x=needed_tokens,
            line_dash="dash",
            line_color=color("needed"),
            annotation_text=f"needs {needed_tokens:,} tokens",
        )
    if gpu_tokens is not None and gpu_tokens <= x_max:
        fig.add_vline(
            x=gpu_tokens,
            line_color=color("fits on the GPU"),
            annotation_text="fits on the GPU",
            annotation_position="bottom right",
        )
    elif gpu_tokens is not None:
        fig.add_annotation(
            text=f"the GPU holds {gpu_tokens:,} tokens →<br>({gpu_tokens / max(working_set, 1):,.0f}× "
            "this traffic's working set)",
            x=1.0,
            xref="paper",
            y=0.05,
            yref="paper",
            xanchor="right",
            showarrow=False,
            font={"color": color("fits on the GPU")},
        )
    fig.update_layout(
        xaxis={**count_axis([0, x_max], "cache capacity (tokens)"), "range": [0, x_max]},
        yaxis={"title": {"text": "token hit rate"}, "tickformat": ".0%", "range": [0, 1.05]},
        margin={"b": BOTTOM_MARGIN},
        height=400,
    )
    return legend_above(fig)
