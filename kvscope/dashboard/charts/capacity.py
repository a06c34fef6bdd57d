"""Hit rate vs cache capacity: the one-pass curve as a figure, and the capacity a target needs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go


def curve_frame(capacities: np.ndarray, hit_tokens: np.ndarray, prompt_tokens: int) -> pd.DataFrame:
    """The curve's breakpoints as (capacity_tokens, hit_rate), a step function from zero."""
    rate = hit_tokens / max(prompt_tokens, 1)
    return pd.DataFrame({"capacity_tokens": np.concatenate(([0], capacities)),
                         "hit_rate": np.concatenate(([0.0], rate))})


def capacity_for(curve: pd.DataFrame, target_rate: float) -> int | None:
    """The smallest capacity whose hit rate reaches the target, or None if none does."""
    reached = curve[curve["hit_rate"] >= target_rate - 1e-12]
    return None if reached.empty else int(reached["capacity_tokens"].iloc[0])


def capacity_figure(curve: pd.DataFrame, target_rate: float, needed_tokens: int | None,
                    gpu_tokens: int | None = None) -> go.Figure:
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=curve["capacity_tokens"], y=curve["hit_rate"], mode="lines", line_shape="hv",
                             name="token hit rate"))
    fig.add_hline(y=target_rate, line_dash="dot", annotation_text=f"target {target_rate:.0%}")
    if needed_tokens is not None:
        fig.add_vline(x=needed_tokens, line_dash="dash", annotation_text=f"needs {needed_tokens:,} tokens")
    if gpu_tokens is not None:
        fig.add_vline(x=gpu_tokens, line_color="green", annotation_text="fits on the GPU",
                      annotation_position="bottom right")
    fig.update_layout(xaxis_title="cache capacity (tokens)", yaxis_title="token hit rate", yaxis_tickformat=".0%",
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=380)
    return fig
