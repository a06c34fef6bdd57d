"""Rebuild the node table at a step from a snapshot and the structural events after it.

NOTE: what each event does to the table (see events.py for the fields)
    insert     new node node_id under parent `aux`, num_tokens tokens, lock 0, hits 1
    split      new node node_id takes the first num_tokens tokens of node `aux` and its place
    evict      node loses num_tokens from its tail; at zero it is gone
    lock       +1 lock_ref on the node and every ancestor (unlock: -1)
    tombstone  the node's SWA half is gone (revive: it is back)
Hit counts and access times of nodes born after the snapshot are approximate.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

COLUMNS = ("node_id", "parent_id", "num_tokens", "token_preview", "lock_ref", "last_access_time", "hit_count",
           "owner", "tombstone", "depth_tokens")


def _apply(nodes: dict[int, dict[str, Any]], ev: Any) -> None:
    node = nodes.get(ev.node_id)
    if ev.kind == "insert":
        nodes[ev.node_id] = {"node_id": ev.node_id, "parent_id": ev.aux, "num_tokens": ev.num_tokens,
                             "token_preview": "", "lock_ref": 0, "last_access_time": ev.t_mono, "hit_count": 1,
                             "owner": None, "tombstone": False, "depth_tokens": 0}
    elif ev.kind == "split" and ev.aux in nodes:
        child = nodes[ev.aux]
        nodes[ev.node_id] = {**child, "node_id": ev.node_id, "num_tokens": ev.num_tokens, "token_preview": ""}
        child["parent_id"] = ev.node_id
        child["num_tokens"] -= ev.num_tokens
    elif ev.kind == "evict" and node is not None:
        node["num_tokens"] -= ev.num_tokens
        if node["num_tokens"] <= 0:
            del nodes[ev.node_id]
    elif ev.kind in ("lock", "unlock"):
        delta = 1 if ev.kind == "lock" else -1
        while node is not None and node["parent_id"] is not None:
            node["lock_ref"] += delta
            node = nodes.get(node["parent_id"])
    elif ev.kind in ("tombstone", "revive") and node is not None:
        node["tombstone"] = ev.kind == "tombstone"


def replay_tree(snapshot: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    nodes = {int(r["node_id"]): r for r in snapshot.reindex(columns=list(COLUMNS)).to_dict("records")}
    for ev in events.itertuples():
        _apply(nodes, ev)
    depth: dict[int, int] = {}

    def depth_of(node_id: int) -> int:
        if node_id not in depth:
            node = nodes[node_id]
            parent = node["parent_id"]
            up = depth_of(int(parent)) if parent is not None and parent in nodes else 0
            depth[node_id] = up + int(node["num_tokens"])
        return depth[node_id]

    for node_id in nodes:
        nodes[node_id]["depth_tokens"] = depth_of(node_id)
    return pd.DataFrame(list(nodes.values()), columns=list(COLUMNS)).astype({"parent_id": "Int64"})
