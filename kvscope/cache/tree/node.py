"""Radix tree nodes (NodeBase, what every family's node carries; TreeNode, the radix tree's),
the node operations the families share (page-keyed compare, split, slots as a tensor, walk),
and the views of a tree: text print and the flat node table.

NOTE: `key` holds the node's token ids as int32 bytes (4 bytes a token), so a child is
found by the bytes of its first page and a whole node is compared with one memcmp.
`value` holds the node's KV slots (int64 numpy), one per token: len(value) == len(key)//4.
A node whose `parent` is None and is not the root has been deleted from the tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol, Self, TypeVar

import numpy as np
import torch

from kvscope.cache.base import CacheMisuseError, NodeRow
from kvscope.telemetry import EventKind, Recorder
from kvscope.telemetry.page_hash import PAGE_HASH_BYTES, chained_digests

TOKEN_BYTES = 4
EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_node_ids = itertools.count()  # NOTE: one count for every family: ids in creation order, as captures store them


class NodeBase:
    """What every family's node carries: its identity, key, lock count and the fields the
    eviction policies read. A family's node class adds its children, value and own state.

    NOTE: `parent` is None for the root and for a node deleted from the tree."""

    __slots__ = (
        "creation_time",
        "hit_count",
        "id",
        "key",
        "last_access_time",
        "lock_ref",
        "owner",
        "parent",
        "priority",
    )

    def __init__(self, key: bytes = b"", now: float = 0.0) -> None:
        self.id = next(_node_ids)
        self.parent: Self | None = None
        self.key = key
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = 0
        self.owner: str | None = None

    @property
    def key_len(self) -> int:
        """Tokens in the key (equal to the device slots wherever the node holds them)."""
        return len(self.key) // TOKEN_BYTES

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=np.int32)


class TreeNode(NodeBase):
    """A node of the radix tree: one child per first page, one slot per key token."""

    __slots__ = ("children", "value")

    def __init__(self, key: bytes = b"", value: np.ndarray = EMPTY_SLOTS, now: float = 0.0) -> None:
        # NOTE: NodeBase.__init__'s fields set here, not by a super() call: every insert and split makes
        # one (a slot left unset fails at its first read)
        self.id = next(_node_ids)
        self.parent: Self | None = None
        self.key = key
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = 0
        self.owner: str | None = None
        self.children: dict[bytes, Self] = {}
        self.value = value

    @property
    def num_tokens(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id}, tokens={len(self.value)}, lock_ref={self.lock_ref})"


class SlotNode(Protocol):
    """A node the shared machinery (core.py) reads: device slots in `value` (an int64 array on
    every node it locks, evicts or counts)."""

    id: int
    key: bytes
    lock_ref: int
    last_access_time: float
    creation_time: float
    hit_count: int
    priority: int
    parent: Self | None
    value: Any


class FiledNode(Protocol):
    """A node whose children are filed one per first page (every family but the scoped one)."""

    id: int
    key: bytes
    lock_ref: int
    hit_count: int

    @property
    def children(self) -> dict[bytes, Self]: ...


T = TypeVar("T", bound=TreeNode)
P = TypeVar("P", bound=SlotNode)
F = TypeVar("F", bound=FiledNode)


def common_page_len(node_key: bytes, key: bytes, pos: int, page_size: int) -> int:
    """Tokens a node's key shares with key[pos:], rounded down to whole pages."""
    a = np.frombuffer(node_key, dtype=np.int32)
    b = np.frombuffer(key, dtype=np.int32, offset=pos)[: len(a)]
    a = a[: len(b)]
    diff = np.flatnonzero(a != b)
    shared = int(diff[0]) if len(diff) else len(a)
    return shared // page_size * page_size


def split_node(child: T, split_len: int, page_bytes: int, recorder: Recorder) -> T:
    """Cut `child` after split_len tokens; the new upper node (of child's class) takes its place
    under the parent.

    NOTE: both halves keep the lock ref, the hit count, priority and owner; the upper half is a new
    node, as SGLang 0.5.23's `_split_node` makes one: its last_access_time and creation_time are
    child's last_access_time (the walk that splits sets it to now first), so fifo / filo see the
    upper piece as created at the split. A family with more state per node copies it after.
    """
    parent = child.parent
    assert parent is not None
    cut = split_len * TOKEN_BYTES
    upper = type(child)(child.key[:cut], child.value[:split_len], child.last_access_time)
    upper.parent, upper.lock_ref = parent, child.lock_ref
    upper.hit_count, upper.priority, upper.owner = child.hit_count, child.priority, child.owner
    child.key, child.value, child.parent = child.key[cut:], child.value[split_len:], upper
    upper.children[child.key[:page_bytes]] = child
    parent.children[upper.key[:page_bytes]] = upper
    if recorder.enabled:
        recorder.record(EventKind.SPLIT, node_id=upper.id, num_tokens=split_len, aux=child.id)
    return upper


def up_path(node: P) -> Iterator[P]:
    """`node` and its ancestors up to the root, the root excluded (it has no parent)."""
    while (parent := node.parent) is not None:
        yield node
        node = parent


def foreign_tokens(node: TreeNode, user: str | None) -> int:
    """Tokens on the path from the root to `node` in nodes owned by a principal other than
    `user` (a node with no owner counts for nobody): a match's cross-principal reuse."""
    num_tokens = 0
    while node.parent is not None:
        if node.owner is not None and node.owner != user:
            num_tokens += len(node.value)
        node = node.parent
    return num_tokens


class Filed(Protocol):
    key: bytes

    @property
    def parent(self) -> Self | None: ...

    @property
    def children(self) -> dict[bytes, Self]: ...


def detach_child(leaf: Filed, page_bytes: int) -> None:
    """Take `leaf` out of its parent's children (one child per first page)."""
    assert leaf.parent is not None
    del leaf.parent.children[leaf.key[:page_bytes]]


def slots_tensor(values: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """The concatenated slot arrays of a matched path as one int64 tensor on `device`."""
    joined = values[0] if len(values) == 1 else np.concatenate(values) if values else EMPTY_SLOTS
    tensor = torch.from_numpy(joined)
    return tensor if device.type == "cpu" else tensor.to(device)


def claim_slots(in_tree: np.ndarray, value: np.ndarray) -> None:
    """Strict mode: mark `value` as tree slots, refusing any slot the tree already holds."""
    taken = value[in_tree[value]]
    if len(taken):
        raise CacheMisuseError(f"strict: slots already in the tree inserted again: {taken[:16].tolist()}")
    in_tree[value] = True


def node_values(nodes: list[TreeNode]) -> np.ndarray:
    """The slots of `nodes`, concatenated."""
    return np.concatenate([n.value for n in nodes]) if nodes else EMPTY_SLOTS


def walk(root: F) -> list[tuple[F, int, int]]:
    """(node, depth in nodes, depth in tokens at the node's start), depth-first, root first."""
    out: list[tuple[F, int, int]] = []
    stack: list[tuple[F, int, int]] = [(root, 0, 0)]
    while stack:
        node, depth, start = stack.pop()
        out.append((node, depth, start))
        end = start + len(node.key) // TOKEN_BYTES  # NOTE: from the key: a hiradix host-only node holds no device slots
        stack += [(c, depth + 1, end) for c in reversed(list(node.children.values()))]
    return out


class Keyed(Protocol):
    key: bytes


def preview(node: Keyed, num_tokens: int) -> str:
    key = node.key
    ids = memoryview(key[: num_tokens * TOKEN_BYTES]).cast("i").tolist()  # NOTE: int32 tokens, as token_ids()
    return " ".join(map(str, ids)) + (" …" if len(key) > num_tokens * TOKEN_BYTES else "")


PageHashMemo = dict[tuple[int, int, bytes | None], tuple[bytes, bytes | None]]
"""(node id, key length, the digest it chains on) -> (its page_hashes, the digest its children chain on):
a node's pages change only when a split cuts its front (its key length changes) or its parent chain does."""


def page_hashes(
    walked: list[tuple[Any, int, int]], page_size: int, memo: PageHashMemo | None = None
) -> dict[int, bytes | None]:
    """Each node's NodeRow.page_hashes by node id, for a walk that lists parents first (root: b"").
    None for a node whose key is not whole pages, and for its subtree (its chain breaks). `memo`: the
    last call's results, reused and replaced in place by this walk's (a snapshot then hashes only the
    nodes that are new or were split since the last one: sha256 costs ~0.7 us a page)."""
    page_bytes = page_size * TOKEN_BYTES
    chain: dict[int, bytes | None] = {}  # NOTE: node id -> the digest its children chain on (None: the root's)
    out: dict[int, bytes | None] = {}
    old_memo, new_memo = memo or {}, {}
    for node, depth, _ in walked:
        if depth == 0:
            chain[node.id], out[node.id] = None, b""
            continue
        parent = node.parent
        if parent is None or parent.id not in chain or len(node.key) % page_bytes:
            out[node.id] = None
            continue
        key = (node.id, len(node.key), chain[parent.id])
        found = new_memo[key] = old_memo.get(key) or _node_hashes(node.key, page_bytes, chain[parent.id])
        out[node.id], chain[node.id] = found
    if memo is not None:  # NOTE: only the nodes still in the tree stay
        memo.clear()
        memo.update(new_memo)
    return out


def _node_hashes(key: Any, page_bytes: int, parent_digest: bytes | None) -> tuple[bytes, bytes | None]:
    digests = chained_digests(key, page_bytes, parent_digest)
    return b"".join(d[:PAGE_HASH_BYTES] for d in digests), digests[-1] if digests else parent_digest


def export_rows(
    root: T,
    preview_tokens: int = 8,
    tombstone: Callable[[T], bool] | None = None,
    page_size: int = 1,
    memo: PageHashMemo | None = None,
) -> list[NodeRow]:
    """NOTE: positional NodeRow fields (a tree snapshot exports every node: it is on the engine's time).
    `tombstone`: the family's flag (a radix tree has none); visibility is public (no scopes)."""
    walked = walk(root)
    hashes = page_hashes(walked, page_size, memo)
    return [
        NodeRow(
            node.id,
            None if node.parent is None else node.parent.id,
            len(node.value),
            preview(node, preview_tokens),
            node.lock_ref,
            node.last_access_time,
            node.hit_count,
            node.owner,
            tombstone is not None and tombstone(node),
            start + len(node.value),
            "public",
            "device",
            hashes[node.id],
        )
        for node, _, start in walked
    ]


def render(
    root: F,
    preview_tokens: int = 6,
    extra: Callable[[F], str] | None = None,
    tombstone: Callable[[F], bool] | None = None,
) -> str:
    lines = []
    for node, depth, _ in walk(root):
        if node is root:
            lines.append(f"root [{node.id}]")
            continue
        flags = " tombstone" if tombstone is not None and tombstone(node) else ""
        more = f" {extra(node)}" if extra else ""
        lines.append(
            f"{'  ' * depth}[{node.id}] {len(node.key) // TOKEN_BYTES} tok lock={node.lock_ref} "
            f"hits={node.hit_count}{flags}{more}: {preview(node, preview_tokens)}"
        )
    return "\n".join(lines)
