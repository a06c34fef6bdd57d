"""The radix tree as an icicle: subtree sums, a node cap, colouring, and a diff of two steps.

NOTE: the node table (telemetry tree_at): node_id, parent_id (root: null), num_tokens,
token_preview, lock_ref, last_access_time, hit_count, owner, tombstone, depth_tokens, visibility
(None for a node born after the last snapshot that no promote or demote named), tier (device,
device+host or host; absent from a hand-made table: device).
`value` below is the subtree's token count (the node's own tokens plus all descendants'),
which plotly's branchvalues="total" needs. last_access_time is the cache's own clock
(monotonic seconds for the radix cache, a logical counter for the SWA radix cache), so
idle is measured against the newest access in the same tree.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from kvscope.dashboard.charts.style import BOTTOM_MARGIN, color, count_axis, legend_above, owner_color
from kvscope.dashboard.charts.tiers import TIER_COLORS, TIERS

COLOR_FIELDS = ("lock_ref", "idle", "hit_count", "owner", "visibility", "tombstone", "tier")
CATEGORICAL = {"owner", "visibility", "tombstone", "tier"}
UNRECORDED = "visibility not recorded"
VISIBILITIES = ("private", "public", "pinned", UNRECORDED)
DEFAULT_MAX_NODES = 500  # NOTE: the icicle a browser draws: 2,000 nodes kept it a skeleton ~4 s on 2 cores, 500 ~1.7 s
MAX_LEGEND_CATEGORIES = 20  # owners named in the legend; the rest are counted


def subtree_values(nodes: pd.DataFrame) -> pd.DataFrame:
    """The table with `value` = tokens in the node's subtree and `idle` = newest access - its access."""
    out = nodes.copy()
    ids = [int(i) for i in out["node_id"]]
    parents = {i: (None if pd.isna(p) else int(p)) for i, p in zip(ids, out["parent_id"], strict=True)}
    own = dict(zip(ids, out["num_tokens"].astype(int), strict=True))
    children: dict[int, list[int]] = {}
    for node, parent in parents.items():
        if parent is not None and parent in own:
            children.setdefault(parent, []).append(node)
    total: dict[int, int] = {}
    for root in [n for n, p in parents.items() if p is None or p not in own]:
        stack: list[tuple[int, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                total[node] = own[node] + sum(total[c] for c in children.get(node, []))
            else:
                stack.append((node, True))
                stack.extend((c, False) for c in children.get(node, []))
    out["value"] = [total.get(i, own[i]) for i in ids]
    access = out["last_access_time"].astype(float)
    out["idle"] = access.max() - access if len(out) else access
    return out


def cap_nodes(nodes: pd.DataFrame, max_nodes: int = DEFAULT_MAX_NODES) -> pd.DataFrame:
    """At most about `max_nodes` nodes: the largest subtrees by tokens, plus their ancestors."""
    if len(nodes) <= max_nodes:
        return nodes
    by_id = nodes.set_index("node_id", drop=False)
    keep = set(nodes.nlargest(max_nodes, "value")["node_id"].astype(int))
    parent_of = {int(k): (None if pd.isna(v) else int(v)) for k, v in by_id["parent_id"].items()}
    for node in list(keep):
        parent = parent_of.get(node)
        while parent is not None and parent not in keep and parent in parent_of:
            keep.add(parent)
            parent = parent_of[parent]
    return nodes[nodes["node_id"].astype(int).isin(keep)]


def _labels(nodes: pd.DataFrame) -> list[str]:
    return [("root" if pd.isna(p) else f"#{int(i)}") for i, p in zip(nodes["node_id"], nodes["parent_id"], strict=True)]


def _hover(nodes: pd.DataFrame, show_preview: bool) -> list[str]:
    rows = []
    for r in nodes.itertuples():
        text = (
            f"node {int(r.node_id)}<br>tokens {int(r.num_tokens)} (subtree {int(r.value)})<br>"
            f"lock_ref {int(r.lock_ref)} · hits {int(r.hit_count)} · idle {float(r.idle):.3g}<br>"
            f"owner {r.owner if isinstance(r.owner, str) else '-'} · {_visibility(r)} · "
            f"tombstone {bool(r.tombstone)} · tier {_tier(r)}"
        )
        if show_preview and r.token_preview:
            text += f"<br>tokens: {r.token_preview}"
        rows.append(text)
    return rows


def _visibility(row: Any) -> str:
    value = getattr(row, "visibility", None)
    return value if isinstance(value, str) and value else UNRECORDED


def _tier(row: Any) -> str:
    value = getattr(row, "tier", None)
    return value if isinstance(value, str) and value in TIERS else "device"


def _is_root(nodes: pd.DataFrame) -> pd.Series:
    return nodes["parent_id"].isna()


def _category_names(nodes: pd.DataFrame, color_by: str) -> list[str]:
    """Each node's category, as its legend names it."""
    if color_by == "tombstone":
        return ["tombstone" if bool(t) else "live" for t in nodes["tombstone"]]
    if color_by == "visibility":
        return [_visibility(r) for r in nodes.reindex(columns=["visibility"]).itertuples()]
    if color_by == "tier":
        return [_tier(r) for r in nodes.reindex(columns=["tier"]).itertuples()]
    return [o if isinstance(o, str) and o else "no owner" for o in nodes["owner"]]


def _category_color(name: str, color_by: str) -> str:
    if color_by == "tier":
        return TIER_COLORS[name]
    return color(name) if name in ("tombstone", "live", "no owner", *VISIBILITIES) else owner_color(name)


def _marker(nodes: pd.DataFrame, color_by: str) -> dict[str, Any]:
    """Icicle colours. A numeric field's scale spans the nodes below the root: the root's lock is
    permanent (and every match passes it), so it takes the scale's low end and sets no range."""
    if color_by in CATEGORICAL:
        return {"colors": [_category_color(name, color_by) for name in _category_names(nodes, color_by)]}
    values = nodes[color_by].astype(float)
    roots = _is_root(nodes)
    ranged = values[~roots] if (~roots).any() else values
    cmin = float(ranged.min()) if len(ranged) else 0.0
    cmax = max(float(ranged.max()) if len(ranged) else 0.0, cmin + 1.0)
    return {
        "colors": values.where(~roots, cmin).tolist(),
        "colorscale": "Viridis",
        "cmin": cmin,
        "cmax": cmax,
        "showscale": True,
        "colorbar": {"title": {"text": f"{color_by}<br>(root not coloured)"}},
    }


def _category_legend(fig: go.Figure, nodes: pd.DataFrame, color_by: str) -> None:
    """One legend entry per category (an icicle has no legend of its own), on hidden axes; the
    counts leave out the root (no page, no cached tokens), as the pages' captions do."""
    names = pd.Series(_category_names(nodes[~_is_root(nodes)], color_by)).value_counts()
    shown = names.index[:MAX_LEGEND_CATEGORIES]
    for name in shown:
        label = name if color_by != "owner" or name == "no owner" else f"owner {name}"
        count = int(names[name])
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"{label} ({count:,} node{'' if count == 1 else 's'})",
                marker={"color": _category_color(str(name), color_by), "size": 12, "symbol": "square"},
                hoverinfo="skip",
            )
        )
    if len(names) > len(shown):
        fig.add_annotation(
            text=f"+{len(names) - len(shown):,} more owners",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=1.0,
            y=1.02,
            xanchor="right",
            yanchor="bottom",
        )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(plot_bgcolor="rgba(0,0,0,0)", showlegend=True)


def tree_figure(nodes: pd.DataFrame, color_by: str = "lock_ref", show_preview: bool = False) -> go.Figure:
    """An icicle sized by subtree tokens. `nodes` must come from subtree_values (and cap_nodes)."""
    if color_by not in COLOR_FIELDS:
        raise ValueError(f"colour by one of {COLOR_FIELDS}, not {color_by!r}")
    kept = set(nodes["node_id"].astype(int))
    parents = ["" if pd.isna(p) or int(p) not in kept else str(int(p)) for p in nodes["parent_id"]]
    fig = go.Figure(
        go.Icicle(
            ids=nodes["node_id"].astype(int).astype(str),
            parents=parents,
            values=nodes["value"],
            labels=_labels(nodes),
            branchvalues="total",
            marker=_marker(nodes, color_by),
            hovertext=_hover(nodes, show_preview),
            hoverinfo="text",
            tiling={"orientation": "v"},
            maxdepth=12,
        )
    )
    fig.update_layout(height=540, margin={"l": 10, "r": 10, "b": 10})
    if color_by in CATEGORICAL:
        _category_legend(fig, nodes, color_by)
    return legend_above(fig, top_margin=40)


def tree_diff(before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """Per node present at either step: tokens before/after and the change (new, grew, shrank, evicted)."""
    a = before.set_index("node_id")["num_tokens"].astype(int)
    b = after.set_index("node_id")["num_tokens"].astype(int)
    both = pd.concat({"tokens_before": a, "tokens_after": b}, axis=1).fillna(0).astype(int)
    both["delta"] = both["tokens_after"] - both["tokens_before"]
    change = pd.Series("same", index=both.index)
    change[(both["tokens_before"] == 0) & (both["tokens_after"] > 0)] = "new"
    change[(both["tokens_before"] > 0) & (both["tokens_after"] == 0)] = "evicted"
    change[(both["tokens_before"] > 0) & (both["tokens_after"] > 0) & (both["delta"] > 0)] = "grew"
    change[(both["tokens_before"] > 0) & (both["tokens_after"] > 0) & (both["delta"] < 0)] = "shrank"
    both["change"] = change
    out = both.reset_index().rename(columns={"index": "node_id"})
    return out[out["change"] != "same"].sort_values("delta", key=abs, ascending=False).reset_index(drop=True)


def tree_diff_figure(diff: pd.DataFrame) -> go.Figure:
    """Tokens gained and lost by kind of change."""
    order = ["new", "grew", "shrank", "evicted"]
    sums = diff.groupby("change")["delta"].sum().reindex(order, fill_value=0)
    counts = diff.groupby("change").size().reindex(order, fill_value=0)
    fig = go.Figure(
        go.Bar(
            x=order,
            y=sums,
            marker_color=[color(c) for c in order],
            name="token change",
            text=[f"{c} nodes" for c in counts],
        )
    )
    fig.update_layout(height=280, margin={"t": 10, "b": BOTTOM_MARGIN}, yaxis=count_axis(sums, "token change"))
    return fig
