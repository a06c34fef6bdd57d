"""The tree replay and the lock and request carries give exactly what their first, per-record versions
gave, kept here as the reference models, on random inputs: snapshots whose links loop or name missing
nodes, reused node ids, locks taken and released in one chunk or carried over many, pair keys too wide
for one int64 (the lexsort path), held locks composed in blocks of any size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from unittest.mock import patch

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.telemetry import carry
from kvscope.telemetry import tree_replay as tr
from kvscope.telemetry.events import EventKind
from kvscope.telemetry.schema import TREE_NODE_COLUMNS

# -- the reference tree replay (tree_replay.py before its parent links became int | None) -----------


def ref_insert(nodes: tr.Nodes, ev: Any) -> None:
    reason = getattr(ev, "reason", None)
    nodes[ev.node_id] = {
        **tr.NEW_NODE,
        "node_id": ev.node_id,
        "parent_id": ev.aux,
        "num_tokens": ev.num_tokens,
        "last_access_time": ev.t_mono,
        "owner": ev.principal,
        "visibility": reason if reason in tr.VISIBILITIES else "public",
        "tier": "host" if getattr(ev, "pool", None) == "host" else "device",
    }


def ref_add_lock(nodes: tr.Nodes, node_id: int, delta: int) -> None:
    node = nodes.get(node_id)
    walked = 0
    while node is not None and not pd.isna(node["parent_id"]) and walked <= len(nodes):
        node["lock_ref"] += delta
        node = nodes.get(node["parent_id"])
        walked += 1


REF_APPLY = {
    **tr.APPLY,
    EventKind.INSERT: ref_insert,
    EventKind.LOCK: lambda nodes, ev: ref_add_lock(nodes, ev.node_id, 1),
    EventKind.UNLOCK: lambda nodes, ev: ref_add_lock(nodes, ev.node_id, -1),
}


def ref_parent(nodes: tr.Nodes, node_id: int) -> int | None:
    parent = nodes[node_id]["parent_id"]
    return None if parent is None or pd.isna(parent) or int(parent) not in nodes else int(parent)


def ref_cut_stale_links(nodes: tr.Nodes) -> int | None:
    roots = [n for n, node in nodes.items() if node["parent_id"] is None or pd.isna(node["parent_id"])]
    root = roots[0] if len(roots) == 1 else None
    for node in nodes.values():
        parent = ref_parent(nodes, int(node["node_id"]))
        if parent is not None and nodes[parent][tr.BORN] > node[tr.BORN]:
            node["parent_id"] = root
    return root


def ref_depth_of(nodes: tr.Nodes, node_id: int, depth: dict[int, int], root: int | None) -> int:
    path: list[int] = []
    on_path: set[int] = set()
    up: int | None = node_id
    while up is not None and up not in depth:
        if up in on_path:
            nodes[path[-1]]["parent_id"] = root
            break
        path.append(up)
        on_path.add(up)
        up = ref_parent(nodes, up)
    for node in reversed(path):
        parent = ref_parent(nodes, node)
        depth[node] = (depth[parent] if parent is not None else 0) + int(nodes[node]["num_tokens"])
    return depth[node_id]


def ref_replay_tree(snapshot: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    nodes = {int(r["node_id"]): r for r in snapshot.reindex(columns=list(TREE_NODE_COLUMNS)).to_dict("records")}
    for node in nodes.values():
        node[tr.BORN] = -1
    for order, ev in enumerate(events.itertuples()):
        apply = REF_APPLY.get(ev.kind)
        if apply is not None:
            apply(nodes, ev)
            if ev.kind == EventKind.INSERT:
                nodes[ev.node_id][tr.BORN] = order
    root = ref_cut_stale_links(nodes)
    depth = {} if root is None else {root: int(nodes[root]["num_tokens"])}
    for node_id in nodes:
        nodes[node_id]["depth_tokens"] = ref_depth_of(nodes, node_id, depth, root)
    return pd.DataFrame(list(nodes.values()), columns=list(TREE_NODE_COLUMNS)).astype({"parent_id": "Int64"})


# -- random snapshots and events --------------------------------------------------------------------

NODE_IDS = st.integers(0, 12)
KINDS = [k.value for k in tr.APPLY] + [EventKind.MATCH.value]  # NOTE: a kind replay skips, too
REASONS = [None, "private", "pinned", "public", "to-host", "capacity"]


@st.composite
def snapshots(draw: Any) -> pd.DataFrame:
    """A node table whose links may loop, name a missing node or none (a root, NaN as read)."""
    ids = draw(st.lists(NODE_IDS, unique=True, max_size=10))
    rows = []
    for node_id in ids:
        parent = draw(st.one_of(st.none(), NODE_IDS, st.sampled_from(ids) if ids else NODE_IDS))
        rows.append(
            {
                "node_id": node_id,
                "parent_id": np.nan if parent is None else float(parent),
                "num_tokens": draw(st.integers(0, 6)),
                "token_preview": draw(st.sampled_from(["", "ab"])),
                "lock_ref": draw(st.integers(0, 3)),
                "last_access_time": draw(st.floats(0, 10)),
                "hit_count": draw(st.integers(0, 3)),
                "owner": draw(st.sampled_from([None, "alice", "bob"])),
                "tombstone": draw(st.integers(0, 1)),
                "depth_tokens": 0,
                "visibility": draw(st.sampled_from(["public", "private", "pinned"])),
                "tier": draw(st.sampled_from(["device", "host", "device+host"])),
                "page_hashes": None,
            }
        )
    return pd.DataFrame(rows, columns=list(TREE_NODE_COLUMNS)).astype({"parent_id": "float64"})


@st.composite
def event_frames(draw: Any) -> pd.DataFrame:
    """Structural events as Capture.events reads them; aux is nullable (an insert without a parent)."""
    rows = draw(
        st.lists(
            st.tuples(
                st.sampled_from(KINDS),
                st.sampled_from(["device", "host", None]),
                NODE_IDS,
                st.integers(1, 5),
                st.one_of(st.none(), NODE_IDS),
                st.sampled_from(REASONS),
                st.sampled_from([None, "alice"]),
            ),
            max_size=40,
        )
    )
    frame = pd.DataFrame(rows, columns=["kind", "pool", "node_id", "num_tokens", "aux", "reason", "principal"])
    frame.insert(0, "step", np.arange(len(frame), dtype=np.int64))
    frame["aux"] = pd.array(frame["aux"].tolist(), dtype="Int64")
    frame["t_mono"] = np.arange(len(frame), dtype=np.float64) / 2
    return frame.astype({"kind": "str", "node_id": "int64", "num_tokens": "int64"})


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(), event_frames())
def test_replay_equals_the_reference(snapshot: pd.DataFrame, events: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(tr.replay_tree(snapshot, events), ref_replay_tree(snapshot, events), check_exact=True)


def test_a_snapshot_whose_links_loop_shows_every_node_under_the_root() -> None:
    rows = [(0, None, 1), (1, 2, 2), (2, 3, 3), (3, 1, 4), (4, 3, 5)]  # NOTE: 1 -> 2 -> 3 -> 1, 4 below 3
    snapshot = pd.DataFrame(rows, columns=["node_id", "parent_id", "num_tokens"]).astype({"parent_id": "float64"})
    snapshot["lock_ref"] = 0
    events = pd.DataFrame({"kind": ["lock"], "node_id": [4], "num_tokens": [0], "aux": [0], "t_mono": [0.0]})
    events["principal"] = None
    replayed = tr.replay_tree(snapshot, events)
    pd.testing.assert_frame_equal(replayed, ref_replay_tree(snapshot, events), check_exact=True)
    # NOTE: the lock walked 4 3 1 2 3 1 (len(nodes) + 1 nodes) round the loop; then the depth walk from 1
    # found 3's link closing it: 3 goes under the root
    assert replayed["lock_ref"].tolist() == [0, 2, 1, 2, 1]
    assert replayed["parent_id"].tolist() == [pd.NA, 2, 3, 0, 3]
    assert replayed["depth_tokens"].tolist() == [1, 10, 8, 5, 10]


def test_a_chain_longer_than_one_doubling_round_sums_every_node() -> None:
    num_nodes = 1000
    snapshot = pd.DataFrame(
        {"node_id": range(num_nodes), "parent_id": [np.nan, *range(num_nodes - 1)], "num_tokens": 1}
    )
    replayed = tr.replay_tree(snapshot, pd.DataFrame(columns=["kind", "node_id", "num_tokens", "aux", "t_mono"]))
    assert replayed["depth_tokens"].tolist() == list(range(1, num_nodes + 1))


# -- the reference lock and request carries: stacks walked event by event (lock carries), and carry.py
# before one sort did both (requests) ---------------------------------------------------------------


def model_held(chunks: Sequence[dict[str, np.ndarray]], firsts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(node, holder, seq) of the locks held after every event, one stack per (node, holder)."""
    stacks: dict[tuple[int, int], list[int]] = {}
    for columns, first in zip(chunks, firsts, strict=True):
        mask = np.isin(columns["kind"], [LOCK, UNLOCK]) & (columns["node_id"] != carry.NULL_INT)
        holders = carry._holders(columns, mask, CODES.get).tolist()
        where = np.flatnonzero(mask).tolist()
        for i, holder in zip(where, holders, strict=True):
            stack = stacks.setdefault((int(columns["node_id"][i]), holder), [])
            if columns["kind"][i] == LOCK:
                stack.append(first + i)
            elif stack:
                stack.pop()
    return sorted(((node, holder, seq) for (node, holder), seqs in stacks.items() for seq in seqs), key=lambda r: r[2])


def ref_lock_carry(columns: dict[str, np.ndarray], first_seq: int) -> bytes:
    """Event by event, a stack per (node, holder): an unlock pops its lock, or (none in the chunk)
    releases one carried in; the releases first, by (node, holder), then the locks still held."""
    kind, node = columns["kind"], columns["node_id"]
    mask = np.isin(kind, [LOCK, UNLOCK]) & (node != carry.NULL_INT)
    if not mask.any():
        return b""
    stacks: dict[tuple[int, int], list[int]] = {}
    releases: dict[tuple[int, int], int] = {}
    holder_of = dict(zip(np.flatnonzero(mask).tolist(), carry._holders(columns, mask, CODES.get).tolist(), strict=True))
    for i, holder in holder_of.items():
        key = (int(node[i]), holder)
        stack = stacks.setdefault(key, [])
        if kind[i] == LOCK:
            stack.append(i)
        elif stack:
            stack.pop()
        else:
            releases[key] = releases.get(key, 0) + 1
    released = [key for key, times in sorted(releases.items()) for _ in range(times)]
    held = sorted(i for stack in stacks.values() for i in stack)
    out = np.concatenate(
        [
            carry._records(
                np.array([n for n, _ in released], np.int64),
                np.array([h for _, h in released], np.int64),
                carry.RELEASE,
                0,
            ),
            carry._records(
                node[held],
                np.array([holder_of[i] for i in held], np.int64),
                first_seq + np.array(held, np.int64),
                columns["step"][held],
            ),
        ]
    )
    return out.tobytes()


def ref_held_after(carried: Sequence[np.ndarray]) -> np.ndarray:
    """Record by record, a stack per (node, holder): a release pops the latest lock carried in."""
    records = np.concatenate([*carried, np.zeros(0, carry.LOCK_CARRY_DTYPE)])
    stacks: dict[tuple[int, int], list[int]] = {}
    for i, (node, holder, seq) in enumerate(
        zip(records["node"].tolist(), records["holder"].tolist(), records["seq"].tolist(), strict=True)
    ):
        stack = stacks.setdefault((node, holder), [])
        if seq != carry.RELEASE:
            stack.append(i)
        elif stack:
            stack.pop()
    found = records[sorted(i for stack in stacks.values() for i in stack)]
    return found[np.argsort(found["seq"], kind="stable")]


def old_running_after(carried: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    opens = np.concatenate([np.zeros(0, carry.REQUEST_OPEN_DTYPE), *(o for o, _ in carried)])
    if not len(opens):
        return opens
    open_chunk = np.repeat(np.arange(len(carried)), [len(o) for o, _ in carried])
    latest = len(opens) - 1 - np.unique(opens["rid"][::-1], return_index=True)[1]
    rids, since = opens["rid"][latest], open_chunk[latest]
    closes = np.concatenate([np.zeros(0, np.int64), *(c for _, c in carried)])
    close_chunk = np.repeat(np.arange(len(carried)), [len(c) for _, c in carried])
    mine = np.isin(closes, rids)
    at = np.searchsorted(rids, closes[mine])
    last_close = np.full(len(rids), -1, np.int64)
    np.maximum.at(last_close, at, close_chunk[mine])
    return opens[latest[last_close < since]]


def ref_running_after(carried: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Chunk by chunk: each rid's latest record."""
    latest: dict[int, Any] = {}
    for opens, closes in carried:
        for record in opens:
            latest[int(record["rid"])] = record
        for rid in closes.tolist():
            latest[int(rid)] = None
    found = [latest[rid] for rid in sorted(latest) if latest[rid] is not None]
    return np.array(found, carry.REQUEST_OPEN_DTYPE)


# -- random chunks of lock and request events ------------------------------------------------------

CODES = {"lock": 0, "unlock": 1, "match": 2, "finish": 3, "abort": 4, "retract": 5, "write": 6, "load": 7}
LOCK, UNLOCK = CODES["lock"], CODES["unlock"]
WIDE = 2**40  # NOTE: nodes this far apart with holders this far apart leave no int64 pair key


@st.composite
def lock_chunks(draw: Any) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """Chunks of lock and unlock events (and a few others) on few nodes and holders, so locks are
    taken and released within a chunk and carried across many; rid NO_CODE with reason write|load:
    a host-tier copy's lock."""
    wide = draw(st.booleans())
    sizes = draw(st.lists(st.integers(0, 12), min_size=1, max_size=8))
    chunks, firsts, seq = [], [], 0
    for size in sizes:

        def column(values: list[int], size: int = size) -> np.ndarray:
            return np.array(draw(st.lists(st.sampled_from(values), min_size=size, max_size=size)), np.int64)

        kind = column([LOCK, LOCK, UNLOCK, UNLOCK, CODES["match"]])
        node = column([0, 1, 2, carry.NULL_INT])
        rid = column([carry.NO_CODE, 10, 11])
        reason = column([carry.NO_CODE, CODES["write"], CODES["load"]])
        aux = column([0, 1, 3])
        if wide:
            node = np.where(node == carry.NULL_INT, node, node * WIDE)
            rid = np.where(rid == carry.NO_CODE, rid, rid * 2**30)
        columns = {"kind": kind, "node_id": node, "rid": rid, "reason": reason, "aux": aux}
        columns["step"] = np.arange(seq, seq + len(kind), dtype=np.int64)
        chunks.append(columns)
        firsts.append(seq)
        seq += len(kind)
    return chunks, firsts


@settings(max_examples=250, deadline=None)
@given(lock_chunks(), st.integers(1, 20))
def test_lock_carries_and_held_locks_equal_the_reference(drawn: Any, block_records: int) -> None:
    with patch.object(carry, "BLOCK_RECORDS", block_records):  # NOTE: blocks of a few records, too
        check_lock_carries(*drawn)


def check_lock_carries(chunks: list[dict[str, np.ndarray]], firsts: list[int]) -> None:
    made, expected = [], []
    for columns, first in zip(chunks, firsts, strict=True):
        made.append(carry.read_lock_carry(carry.lock_carry(columns, first, CODES.get)))
        expected.append(carry.read_lock_carry(ref_lock_carry(columns, first)))
        assert made[-1].tobytes() == expected[-1].tobytes()
    held = carry.held_after(made)
    assert held.dtype == carry.LOCK_CARRY_DTYPE
    assert held.tobytes() == ref_held_after(expected).tobytes()
    found = list(zip(held["node"].tolist(), held["holder"].tolist(), held["seq"].tolist(), strict=True))
    assert found == model_held(chunks, firsts)
    for cut in range(len(made) + 1):  # NOTE: and after every chunk: a read at a step between two
        assert carry.held_after(made[:cut]).tobytes() == ref_held_after(expected[:cut]).tobytes()


@st.composite
def request_chunks(draw: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Request carries of chunks of match and end events of a few rids (request_carry: one record per
    rid per chunk); codes spread far apart (scale) take running_after's sorting path."""
    carried, seq, scale = [], 0, draw(st.sampled_from([1, 2**25]))
    for size in draw(st.lists(st.integers(0, 10), min_size=1, max_size=8)):
        kind = np.array(draw(st.lists(st.sampled_from([2, 2, 3, 4, 5, 0]), min_size=size, max_size=size)), np.int64)
        rid = np.array(draw(st.lists(st.sampled_from([carry.NO_CODE, 3, 7, 8, 20]), min_size=size, max_size=size)))
        columns = {
            "kind": kind,
            "rid": np.where(rid == carry.NO_CODE, rid, rid * scale).astype(np.int64),
            "step": np.arange(seq, seq + size, dtype=np.int64),
            "num_tokens": np.arange(size, dtype=np.int64),
        }
        carried.append(carry.read_request_carry(carry.request_carry(columns, seq, CODES.get)))
        seq += size
    return carried


@settings(max_examples=300, deadline=None)
@given(request_chunks())
def test_running_requests_equal_the_reference(carried: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for cut in range(len(carried) + 1):
        running = carry.running_after(carried[:cut])
        assert running.dtype == carry.REQUEST_OPEN_DTYPE
        assert running.tobytes() == old_running_after(carried[:cut]).tobytes()
        assert running.tobytes() == ref_running_after(carried[:cut]).tobytes()
