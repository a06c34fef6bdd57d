"""Rebuild the node table at a step from a snapshot and the structural events after it.

NOTE: what each event does to the table (see events.py for the fields)
    insert     new node node_id under parent `aux`, num_tokens tokens, lock 0, hits 1, owned by
               the event's principal, of the visibility in its reason
    split      new node node_id takes the first num_tokens tokens of node `aux` and its place,
               and keeps its owner, hits and access time
    evict      node loses num_tokens from its tail; at zero it is gone
    lock       +1 lock_ref on the node and every ancestor (unlock: -1)
    tombstone  the node's SWA half is gone (revive: it is back)
    promote    the node becomes public; demote: the node and every node below it become private
    write      (hiradix) the node gains a host copy: tier device -> device+host
    evict      reason to-host: the node keeps its key on the host (tier host), nothing is removed
    revive     a host-only node has device KV again (tier device+host)
    host_evict the node's host copy is gone: a host-only node goes, a device+host one stays on the device
An insert of pool host (an attached engine's page first seen on its host tier) starts at tier host.
An insert event's reason is the new node's visibility (the scoped radix cache: private or pinned);
a global-sharing tree records none, and its nodes are public.
Hit counts and access times of nodes born after the snapshot are approximate. An insert from a
schema-version-1 capture carries no principal: such a node shows no owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from kvscope.telemetry.events import EventKind, EvictReason
from kvscope.telemetry.schema import TREE_NODE_COLUMNS

# an inserted node before its event's fields
NEW_NODE: dict[str, Any] = {
    **dict.fromkeys(TREE_NODE_COLUMNS),
    "token_preview": "",
    "lock_ref": 0,
    "hit_count": 1,
    "tombstone": False,
    "depth_tokens": 0,
    "tier": "device",
}
Nodes = dict[int, dict[str, Any]]
VISIBILITIES = ("private", "public", "pinned")


def _insert(nodes: Nodes, ev: Any) -> None:
    reason = getattr(ev, "reason", None)  # NOTE: global-sharing trees record none; an events frame may omit it
    visibility = reason if reason in VISIBILITIES else "public"
    tier = "host" if getattr(ev, "pool", None) == "host" else "device"
    nodes[ev.node_id] = {
        **NEW_NODE,
        "node_id": ev.node_id,
        "parent_id": ev.aux,
        "num_tokens": ev.num_tokens,
        "last_access_time": ev.t_mono,
        "owner": ev.principal,
        "visibility": visibility,
        "tier": tier,
    }


def _split(nodes: Nodes, ev: Any) -> None:
    child = nodes.get(ev.aux)
    if child is not None:
        nodes[ev.node_id] = {**child, "node_id": ev.node_id, "num_tokens": ev.num_tokens, "token_preview": ""}
        child["parent_id"] = ev.node_id
        child["num_tokens"] -= ev.num_tokens


def _evict(nodes: Nodes, ev: Any) -> None:
    node = nodes.get(ev.node_id)
    if node is not None and getattr(ev, "reason", None) == EvictReason.TO_HOST:
        node["tier"] = "host"
    elif node is not None:
        node["num_tokens"] -= ev.num_tokens
        if node["num_tokens"] <= 0:
            del nodes[ev.node_id]


def _set_tier(nodes: Nodes, node_id: int, tier: str, only_from: str | None = None) -> None:
    node = nodes.get(node_id)
    if node is not None and (only_from is None or node["tier"] == only_from):
        node["tier"] = tier


def _host_evict(nodes: Nodes, node_id: int) -> None:
    node = nodes.get(node_id)
    if node is not None and node["tier"] == "device+host":
        node["tier"] = "device"
    else:
        nodes.pop(node_id, None)


def _revive(nodes: Nodes, ev: Any) -> None:
    """A tombstone got SWA KV again (swa-radix), or a host-only node device KV (hiradix)."""
    _set_tombstone(nodes, ev.node_id, False)
    _set_tier(nodes, ev.node_id, "device+host", only_from="host")


def _add_lock(nodes: Nodes, node_id: int, delta: int) -> None:
    """As inc_lock_ref: the node and its ancestors, not the root (whose parent reads None, or NaN
    from a snapshot frame)."""
    node = nodes.get(node_id)
    while node is not None and not pd.isna(node["parent_id"]):
        node["lock_ref"] += delta
        node = nodes.get(node["parent_id"])


def _set_tombstone(nodes: Nodes, node_id: int, tombstone: bool) -> None:
    node = nodes.get(node_id)
    if node is not None:
        node["tombstone"] = tombstone


def _set_visibility(nodes: Nodes, ev: Any, visibility: str, subtree: bool) -> None:
    if ev.node_id not in nodes:
        return
    marked = {int(ev.node_id)}
    nodes[ev.node_id]["visibility"] = visibility
    if not subtree:
        return
    for node_id in list(nodes):  # NOTE: parents need not come before children: walk up
        path, up = [], node_id
        while up is not None and up not in marked and up in nodes:
            path.append(up)
            up = nodes[up]["parent_id"]
        if up in marked:
            for below in path:
                nodes[below]["visibility"] = visibility
                marked.add(below)


APPLY: dict[EventKind, Callable[[Nodes, Any], None]] = {
    EventKind.INSERT: _insert,
    EventKind.SPLIT: _split,
    EventKind.EVICT: _evict,
    EventKind.LOCK: lambda nodes, ev: _add_lock(nodes, ev.node_id, 1),
    EventKind.UNLOCK: lambda nodes, ev: _add_lock(nodes, ev.node_id, -1),
    EventKind.TOMBSTONE: lambda nodes, ev: _set_tombstone(nodes, ev.node_id, True),
    EventKind.REVIVE: _revive,
    EventKind.PROMOTE: lambda nodes, ev: _set_visibility(nodes, ev, "public", subtree=False),
    EventKind.DEMOTE: lambda nodes, ev: _set_visibility(nodes, ev, "private", subtree=True),
    EventKind.WRITE: lambda nodes, ev: _set_tier(nodes, ev.node_id, "device+host", only_from="device"),
    EventKind.HOST_EVICT: lambda nodes, ev: _host_evict(nodes, ev.node_id),
}
STRUCTURAL_KINDS = tuple(APPLY)  # the kinds that change the node table; every other kind leaves it as it is
REPLAY_COLUMNS = ("step", "kind", "pool", "node_id", "num_tokens", "aux", "reason", "principal", "t_mono")  # read


def replay_tree(snapshot: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """`snapshot`: a node table (TREE_NODE_COLUMNS); `events`: the structural events after it in
    sequence order, with at least kind, node_id, num_tokens, aux, t_mono and principal."""
    nodes = {int(r["node_id"]): r for r in snapshot.reindex(columns=list(TREE_NODE_COLUMNS)).to_dict("records")}
    for ev in events.itertuples():
        apply = APPLY.get(ev.kind)
        if apply is not None:
            apply(nodes, ev)
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
    return pd.DataFrame(list(nodes.values()), columns=list(TREE_NODE_COLUMNS)).astype({"parent_id": "Int64"})
