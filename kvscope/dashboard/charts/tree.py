"""The radix tree as an icicle: subtree sums, a node cap, colouring, and a diff of two steps.

NOTE: the node table (telemetry tree_at): node_id, parent_id (root: null), num_tokens,
token_preview, lock_ref, last_access_time, hit_count, owner, tombstone, depth_tokens.
`value` below is the subtree's token count (the node's own tokens plus all descendants'),
which plotly's branchvalues="total" needs. last_access_time is the cache's own clock
(monotonic seconds for the radix cache, a logical counter for the SWA radix cache), so
idle is measured against the newest access in the same tree.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

COLOR_FIELDS = ("lock_ref", "idle", "hit_count", "owner", "tombstone")
CATEGORICAL = {"owner", "tombstone"}
DEFAULT_MAX_NODES = 2000


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
    return [("root" if pd.isna(p) else f"#{int(i)}") for i, p in zip(nodes["node_id"], nodes["parent_id"],
                                                                       strict=True)]


def _hover(nodes: pd.DataFrame, show_preview: bool) -> list[str]:
    rows = []
    for r in nodes.itertuples():
        text = (f"node {int(r.node_id)}<br>tokens {int(r.num_tokens)} (subtree {int(r.value)})<br>"
                f"lock_ref {int(r.lock_ref)} · hits {int(r.hit_count)} · idle {float(r.idle):.3g}<br>"
                f"owner {r.owner if isinstance(r.owner, str) else '-'} · tombstone {bool(r.tombstone)}")
        if show_preview and r.token_preview:
            text += f"<br>tokens: {r.token_preview}"
        rows.append(text)
    return rows


def _marker(nodes: pd.DataFrame, color_by: str) -> dict[str, Any]:
    if color_by in CATEGORICAL:
        keys = nodes[color_by].astype(str).where(nodes[color_by].notna(), "-")
        palette = px.colors.qualitative.Plotly
        codes = {k: palette[i % len(palette)] for i, k in enumerate(sorted(set(keys)))}
        return {"colors": [codes[k] for k in keys]}
    values = nodes[color_by].astype(float)
    return {"colors": values.tolist(), "colorscale": "Viridis", "showscale": True,
            "colorbar": {"title": {"text": color_by}}}


def tree_figure(nodes: pd.DataFrame, color_by: str = "lock_ref", show_preview: bool = False) -> go.Figure:
    """An icicle sized by subtree tokens. `nodes` must come from subtree_values (and cap_nodes)."""
    if color_by not in COLOR_FIELDS:
        raise ValueError(f"colour by one of {COLOR_FIELDS}, not {color_by!r}")
    kept = set(nodes["node_id"].astype(int))
    parents = ["" if pd.isna(p) or int(p) not in kept else str(int(p)) for p in nodes["parent_id"]]
    fig = go.Figure(go.Icicle(
        ids=nodes["node_id"].astype(int).astype(str), parents=parents, values=nodes["value"],
        labels=_labels(nodes), branchvalues="total", marker=_marker(nodes, color_by),
        hovertext=_hover(nodes, show_preview), hoverinfo="text", tiling={"orientation": "v"},
        maxdepth=12,
    ))
    fig.update_layout(height=520, margin={"t": 10, "l": 10, "r": 10, "b": 10})
    return fig


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
    colors = ["#2ca02c", "#98df8a", "#ff9896", "#d62728"]
    fig = go.Figure(go.Bar(x=order, y=sums, marker_color=colors, text=[f"{c} nodes" for c in counts]))
    fig.update_layout(height=280, margin={"t": 10, "b": 10}, yaxis_title="token change")
    return fig
