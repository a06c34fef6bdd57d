"""The host tier (hiradix): device and host tokens over time, copy rates between the tiers,
host-tier hits as a share of all hits.

NOTE: the usage columns these read (schema version 4; NULL when the run had no host tier):
    host_total, host_available      the host pool's size and free slots (tokens)
    cum_hit_tokens                  prompt tokens served from the cache (both tiers)
    cum_host_hit_tokens             of those, tokens loaded back from the host at admission
    cum_written_tokens              device -> host copies started (write-back / write-through)
    cum_loaded_tokens               host -> device copies started (load-back)
"Allocated" (the charts' word; SGLang's "used" also leaves out evictable tokens) is total -
available: what the tier's allocator has handed out (cached nodes, and on the device, running
requests too). A rate is a cumulative column's change over t_mono's change
between consecutive rows, so it stays right over downsampled buckets of uneven width.
"""

from __future__ import annotations

from typing import NamedTuple

import pandas as pd
import plotly.graph_objects as go

from kvscope.dashboard.charts.style import BOTTOM_MARGIN, COLORS, color, count_axis, legend_above, step_axis

TIERS = ("device", "device+host", "host")  # a tree node's tier (tree_snapshots.tier)
# NOTE: a tier's colour is its pool's (device: the full pool's blue, host: the host pool's pink);
# a node in both tiers takes the purple between them
TIER_COLORS = {"device": COLORS["full"], "device+host": "#9467bd", "host": COLORS["host"]}
WRITTEN = "write-back (device → host)"
LOADED = "load-back (host → device)"
COPY_COLORS = {WRITTEN: COLORS["host"], LOADED: COLORS["full"]}  # the colour of where the copy lands


def has_host_tier(usage: pd.DataFrame) -> bool:
    """The run had a host tier: its usage rows carry host_total (NULL otherwise, absent before v4)."""
    return "host_total" in usage and bool(usage["host_total"].notna().any())


def tier_tokens(usage: pd.DataFrame) -> pd.DataFrame:
    """step, t_mono, and per tier its total and used tokens (total - available)."""
    return pd.DataFrame(
        {
            "step": usage["step"].astype(int),
            "t_mono": usage["t_mono"].astype(float),
            "device_total": usage["full_total"].astype(float),
            "device_used": (usage["full_total"] - usage["full_available"]).astype(float),
            "host_total": usage["host_total"].astype(float),
            "host_used": (usage["host_total"] - usage["host_available"]).astype(float),
        }
    )


def copy_rates(usage: pd.DataFrame, bytes_per_token: int | None = None) -> pd.DataFrame:
    """Per row after the first: step, and tokens/s written to and loaded from the host since the
    row before (plus bytes/s when bytes_per_token is known). A row with no time passed has NaN."""
    seconds = usage["t_mono"].astype(float).diff()
    seconds = seconds.where(seconds > 0)
    out = pd.DataFrame(
        {
            "step": usage["step"].astype(int),
            "written_tokens_per_s": usage["cum_written_tokens"].astype(float).diff() / seconds,
            "loaded_tokens_per_s": usage["cum_loaded_tokens"].astype(float).diff() / seconds,
        }
    )
    if bytes_per_token is not None:
        out["written_bytes_per_s"] = out["written_tokens_per_s"] * bytes_per_token
        out["loaded_bytes_per_s"] = out["loaded_tokens_per_s"] * bytes_per_token
    return out.iloc[1:].reset_index(drop=True)


class CopyTotals(NamedTuple):
    """Tokens copied each way over the rows' span, and the average rates over it."""

    written_tokens: int
    loaded_tokens: int
    seconds: float  # t_mono of the last row - t_mono of the first

    def per_s(self, tokens: int) -> float | None:
        return tokens / self.seconds if self.seconds > 0 else None


def copy_totals(rows: pd.DataFrame, since_start: bool = True) -> CopyTotals:
    """The whole run's copies (since_start: the counters start at 0), or those between the first
    and last of `rows` (a recent window)."""
    first, last = rows.iloc[0], rows.iloc[-1]
    base_written = 0 if since_start else int(first["cum_written_tokens"])
    base_loaded = 0 if since_start else int(first["cum_loaded_tokens"])
    return CopyTotals(
        int(last["cum_written_tokens"]) - base_written,
        int(last["cum_loaded_tokens"]) - base_loaded,
        float(last["t_mono"]) - float(first["t_mono"]),
    )


def host_hit_share(usage: pd.DataFrame) -> pd.Series:
    """Per row: cum_host_hit_tokens / cum_hit_tokens (NaN before the first hit)."""
    hits = usage["cum_hit_tokens"].astype(float)
    return usage["cum_host_hit_tokens"].astype(float) / hits.where(hits > 0)


def tier_tokens_figure(usage: pd.DataFrame) -> go.Figure:
    """Used tokens of each tier (solid) against its total (dotted), over steps."""
    tokens = tier_tokens(usage)
    fig = go.Figure()
    for tier, pool in (("device", "full"), ("host", "host")):
        fig.add_trace(
            go.Scatter(
                x=tokens["step"],
                y=tokens[f"{tier}_used"],
                name=f"{tier} allocated",
                mode="lines",
                line={"color": color(pool)},
            )
        )
        fig.add_trace(
            go.Scatter(
                x=tokens["step"],
                y=tokens[f"{tier}_total"],
                name=f"{tier} total",
                mode="lines",
                line={"color": color(pool), "dash": "dot"},
            )
        )
    values = pd.concat([tokens["device_total"], tokens["host_total"], tokens["device_used"], tokens["host_used"]])
    fig.update_layout(
        height=340,
        hovermode="x unified",
        margin={"b": BOTTOM_MARGIN},
        yaxis=count_axis(values, "tokens"),
        xaxis=step_axis(tokens["step"]),
    )
    return legend_above(fig)


def copy_rates_figure(rates: pd.DataFrame, unit: str = "tokens") -> go.Figure:
    """Write-back and load-back rates over steps, in `unit` ("tokens" or "bytes") per second."""
    fig = go.Figure()
    for name, column in ((WRITTEN, f"written_{unit}_per_s"), (LOADED, f"loaded_{unit}_per_s")):
        fig.add_trace(
            go.Scatter(
                x=rates["step"],
                y=rates[column],
                name=name,
                mode="lines",
                line={"color": COPY_COLORS[name], "shape": "hv"},
            )
        )
    fig.update_layout(
        height=300,
        hovermode="x unified",
        margin={"b": BOTTOM_MARGIN},
        yaxis={"title": {"text": f"{unit} / s"}, "tickformat": "~s", "rangemode": "tozero"},
        xaxis=step_axis(rates["step"]),
    )
    return legend_above(fig)


def host_hit_share_figure(usage: pd.DataFrame) -> go.Figure:
    """Of the tokens hit so far, the share loaded back from the host, over steps."""
    share = host_hit_share(usage)
    fig = go.Figure(
        go.Scatter(
            x=usage["step"].astype(int),
            y=share,
            name="host-tier share of hit tokens",
            mode="lines",
            line={"color": color("host")},
        )
    )
    fig.update_layout(
        height=260,
        margin={"t": 20, "b": BOTTOM_MARGIN},
        yaxis={"title": {"text": "share of hit tokens"}, "tickformat": ".0%", "range": [0, 1.05]},
        xaxis=step_axis(usage["step"]),
        showlegend=False,
    )
    return fig
