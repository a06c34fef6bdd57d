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

from collections import namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np
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
Nodes = dict[int, dict[str, Any]]  # NOTE: a node's parent_id is an int, or None for the root (NaN and NA read as None)
BORN = "_born"  # NOTE: a node's insertion order in the replay (not a column: the table drops it); snapshot: -1
VISIBILITIES = ("private", "public", "pinned")


def _insert(nodes: Nodes, ev: Any) -> None:
    reason = getattr(ev, "reason", None)  # NOTE: global-sharing trees record none; an events frame may omit it
    visibility = reason if reason in VISIBILITIES else "public"
    tier = "host" if getattr(ev, "pool", None) == "host" else "device"
    nodes[ev.node_id] = {
        **NEW_NODE,
        "node_id": ev.node_id,
        "parent_id": _link(ev.aux),
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


def _link(parent: Any) -> int | None:
    """A parent id as the node table holds it: an int, or None for none (None, NaN or NA as read)."""
    return None if parent is None or pd.isna(parent) else int(parent)


def _add_lock(nodes: Nodes, node_id: int, delta: int) -> None:
    """As inc_lock_ref: the node and its ancestors, not the root (whose parent is None)."""
    node = nodes.get(node_id)
    most = len(nodes)  # NOTE: stale links may loop: at most len(nodes) + 1 nodes are walked
    walked = 0
    while node is not None and walked <= most:
        parent = node["parent_id"]
        if parent is None:
            return
        node["lock_ref"] += delta
        node = nodes.get(parent)
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
    nodes = _snapshot_nodes(snapshot)
    for order, ev in enumerate(_rows(events)):
        apply = APPLY.get(ev.kind)
        if apply is not None:
            apply(nodes, ev)
            if ev.kind == EventKind.INSERT:
                nodes[ev.node_id][BORN] = order
    root = _cut_stale_links(nodes)
    if not _chain_depths(nodes):
        depth = {} if root is None else {root: int(nodes[root]["num_tokens"])}
        for node_id in nodes:
            nodes[node_id]["depth_tokens"] = _depth_of(nodes, node_id, depth, root)
    return _node_frame(nodes)


def _chain_depths(nodes: Nodes) -> bool:
    """Sets every node's depth_tokens, the tokens of its chain of parents up to one without a parent
    in the table, and returns True; False (nothing set) when a chain loops (_depth_of cuts the loop).

    NOTE: pointer doubling: after round k, sum[i] holds the tokens of the first 2**k nodes of i's chain
    and up[i] the node after them (-1: the chain ended). A chain without a loop ends within
    log2(len(nodes)) + 1 rounds."""
    index = {node_id: i for i, node_id in enumerate(nodes)}
    up = np.fromiter((index.get(node["parent_id"], -1) for node in nodes.values()), np.int64, len(nodes))
    total = np.fromiter((int(node["num_tokens"]) for node in nodes.values()), np.int64, len(nodes))
    for _ in range(len(nodes).bit_length() + 1):
        going = np.flatnonzero(up >= 0)
        if not len(going):
            break
        above = up[going]
        total[going] += total[above]
        up[going] = up[above]
    if (up >= 0).any():
        return False
    for node, depth in zip(nodes.values(), total.tolist(), strict=True):
        node["depth_tokens"] = depth
    return True


def _snapshot_nodes(snapshot: pd.DataFrame) -> Nodes:
    """A snapshot frame's rows as nodes (each a dict of TREE_NODE_COLUMNS and BORN -1), by node id.
    NOTE: column by column (Series.tolist), not to_dict("records"), which boxes every cell on its own."""
    frame = snapshot.reindex(columns=list(TREE_NODE_COLUMNS))
    values = {name: frame[name].tolist() for name in TREE_NODE_COLUMNS}
    values["parent_id"] = [_link(p) for p in values["parent_id"]]
    values[BORN] = [-1] * len(frame)
    names = list(values)
    return {
        int(node["node_id"]): node
        for node in (dict(zip(names, row, strict=True)) for row in zip(*values.values(), strict=True))
    }


def _rows(events: pd.DataFrame) -> Any:
    """The events as named tuples of Python values (itertuples, without its per-cell boxing of
    extension arrays)."""
    row = namedtuple("row", list(events.columns), rename=True)  # type: ignore[misc]
    return map(row._make, zip(*(events[name].tolist() for name in events.columns), strict=True))


def _node_frame(nodes: Nodes) -> pd.DataFrame:
    """The node table; NOTE: built column by column, as a frame from the rows would be typed (an empty
    one has object columns)."""
    rows = list(nodes.values())
    columns = {name: [node[name] for node in rows] for name in TREE_NODE_COLUMNS}
    frame = pd.DataFrame(columns if rows else None, columns=list(TREE_NODE_COLUMNS), dtype=None if rows else object)
    return frame.astype({"parent_id": "Int64"})


def _parent(nodes: Nodes, node_id: int) -> int | None:
    parent = nodes[node_id]["parent_id"]
    return parent if parent in nodes else None  # NOTE: None is never a node id


def _cut_stale_links(nodes: Nodes) -> int | None:
    """Each link to a parent inserted after its child goes to the root (stale: the id was reused);
    returns the root (the node without a parent), None when there is not exactly one."""
    roots = [n for n, node in nodes.items() if node["parent_id"] is None]
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
