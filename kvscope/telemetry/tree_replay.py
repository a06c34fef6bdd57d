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
NOTE: stale parent links. A node id can be reused: vLLM's block ids are, and a cached block can be
evicted while blocks cached below it stay (orphans; the probe's snapshot shows them under the root). A
child's link then names an id that was evicted and inserted again later, possibly below that child (after
a double free vLLM hands a chain's block out again and may cache it after the chain's own later blocks):
following the link loops. A link is only
the parent's when the parent was inserted no later than the child (each node keeps its insertion
order, BORN; a split's new node takes its child's); a later parent means the link is stale, and the
node shows under the root, as an orphan. A table that still holds a cycle (a snapshot written with
one) shows each node of it: the link that closes the cycle is cut, the node shown under the root.
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
BORN = "_born"  # NOTE: a node's insertion order in the replay (not a column: the table drops it); snapshot: -1
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
    walked = 0
    while node is not None and not pd.isna(node["parent_id"]) and walked <= len(nodes):  # NOTE: stale links may loop
        node["lock_ref"] += delta
        node = nodes.get(node["parent_id"])
        walked += 1


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
        path: list[int] = []
        up = node_id
        while up is not None and up not in marked and up in nodes and len(path) <= len(nodes):
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
    for node in nodes.values():
        node[BORN] = -1
    for order, ev in enumerate(events.itertuples()):
        apply = APPLY.get(ev.kind)
        if apply is not None:
            apply(nodes, ev)
            if ev.kind == EventKind.INSERT:
                nodes[ev.node_id][BORN] = order
    root = _cut_stale_links(nodes)
    depth = {} if root is None else {root: int(nodes[root]["num_tokens"])}
    for node_id in nodes:
        nodes[node_id]["depth_tokens"] = _depth_of(nodes, node_id, depth, root)
    return pd.DataFrame(list(nodes.values()), columns=list(TREE_NODE_COLUMNS)).astype({"parent_id": "Int64"})


def _parent(nodes: Nodes, node_id: int) -> int | None:
    parent = nodes[node_id]["parent_id"]
    return None if parent is None or pd.isna(parent) or int(parent) not in nodes else int(parent)


def _cut_stale_links(nodes: Nodes) -> int | None:
    """Each link to a parent inserted after its child goes to the root (stale: the id was reused);
    returns the root (the node without a parent), None when there is not exactly one."""
    roots = [n for n, node in nodes.items() if node["parent_id"] is None or pd.isna(node["parent_id"])]
    root = roots[0] if len(roots) == 1 else None
    for node in nodes.values():
        parent = _parent(nodes, int(node["node_id"]))
        if parent is not None and nodes[parent][BORN] > node[BORN]:
            node["parent_id"] = root
    return root


def _depth_of(nodes: Nodes, node_id: int, depth: dict[int, int], root: int | None) -> int:
    """The tokens from the root to the end of `node_id`, walking up iteratively; a link that closes a
    cycle is cut (the node goes under the root) so every node is shown."""
    path: list[int] = []
    on_path: set[int] = set()
    up: int | None = node_id
    while up is not None and up not in depth:
        if up in on_path:  # NOTE: the last node walked links back into the path: cut its link
            nodes[path[-1]]["parent_id"] = root
            break
        path.append(up)
        on_path.add(up)
        up = _parent(nodes, up)
    for node in reversed(path):
        parent = _parent(nodes, node)
        depth[node] = (depth[parent] if parent is not None else 0) + int(nodes[node]["num_tokens"])
    return depth[node_id]
