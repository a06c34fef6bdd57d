"""Radix tree nodes, the node operations both radix families share (page-keyed compare,
split, slots as a tensor, walk), and the views of a tree: text print and the flat node table.

NOTE: `key` holds the node's token ids as int32 bytes (4 bytes a token), so a child is
found by the bytes of its first page and a whole node is compared with one memcmp.
`value` holds the node's KV slots (int64 numpy), one per token: len(value) == len(key)//4.
A node whose `parent` is None and is not the root has been deleted from the tree.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from kvscope.cache.base import CacheMisuseError, NodeRow
from kvscope.telemetry import EventKind, Recorder

TOKEN_BYTES = 4
EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_node_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "children",
        "creation_time",
        "hit_count",
        "id",
        "key",
        "last_access_time",
        "lock_ref",
        "owner",
        "parent",
        "priority",
        "swa_lock_id",
        "swa_lock_ref",
        "tombstone",
        "value",
        "visibility",
    )

    def __init__(self, key: bytes = b"", value: np.ndarray = EMPTY_SLOTS, now: float = 0.0) -> None:
        self.id = next(_node_ids)
        self.parent: TreeNode | None = None
        self.children: dict[bytes, TreeNode] = {}
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = 0
        self.owner: str | None = None
        self.visibility = "public"  # private / public / pinned: only the scoped radix cache sets another
        # SWA radix only (kept here so one node type serves both trees)
        self.swa_lock_ref = 0
        self.swa_lock_id: int | None = None
        self.tombstone = False

    @property
    def num_tokens(self) -> int:
        return len(self.value)

    @property
    def key_len(self) -> int:
        """Tokens in the key (equal to num_tokens wherever the node holds device slots)."""
        return len(self.key) // TOKEN_BYTES

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=np.int32)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.value)}, lock_ref={self.lock_ref})"


def common_page_len(node_key: bytes, key: bytes, pos: int, page_size: int) -> int:
    """Tokens a node's key shares with key[pos:], rounded down to whole pages."""
    a = np.frombuffer(node_key, dtype=np.int32)
    b = np.frombuffer(key, dtype=np.int32, offset=pos)[: len(a)]
    a = a[: len(b)]
    diff = np.flatnonzero(a != b)
    shared = int(diff[0]) if len(diff) else len(a)
    return shared // page_size * page_size


def split_node(child: TreeNode, split_len: int, page_bytes: int, recorder: Recorder) -> TreeNode:
    """Cut `child` after split_len tokens; the new upper node takes its place under the parent.

    NOTE: both halves keep the lock refs, the tombstone flag, the hit count, priority, owner,
    visibility and creation time; the upper half takes the swa_lock_id (a window lock that ended at
    child now ends at its upper half) and child's last_access_time.
    """
    parent = child.parent
    assert parent is not None
    cut = split_len * TOKEN_BYTES
    upper = TreeNode(child.key[:cut], child.value[:split_len], child.last_access_time)
    upper.parent, upper.lock_ref, upper.swa_lock_ref = parent, child.lock_ref, child.swa_lock_ref
    upper.hit_count, upper.priority, upper.owner = child.hit_count, child.priority, child.owner
    upper.creation_time, upper.tombstone = child.creation_time, child.tombstone
    upper.visibility = child.visibility
    upper.swa_lock_id, child.swa_lock_id = child.swa_lock_id, None
    child.key, child.value, child.parent = child.key[cut:], child.value[split_len:], upper
    upper.children[child.key[:page_bytes]] = child
    parent.children[upper.key[:page_bytes]] = upper
    if recorder.enabled:
        recorder.record(EventKind.SPLIT, node_id=upper.id, num_tokens=split_len, aux=child.id)
    return upper


def foreign_tokens(node: TreeNode, user: str | None) -> int:
    """Tokens on the path from the root to `node` in nodes owned by a principal other than
    `user` (a node with no owner counts for nobody): a match's cross-principal reuse."""
    num_tokens = 0
    while node.parent is not None:
        if node.owner is not None and node.owner != user:
            num_tokens += len(node.value)
        node = node.parent
    return num_tokens


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


def node_values(root: TreeNode, live_only: bool = False) -> np.ndarray:
    """The slots of every node but the root (live_only: of non-tombstone nodes), concatenated."""
    values = [n.value for n, _, _ in walk(root) if n is not root and not (live_only and n.tombstone)]
    return np.concatenate(values) if values else EMPTY_SLOTS


def walk(root: TreeNode) -> list[tuple[TreeNode, int, int]]:
    """(node, depth in nodes, depth in tokens at the node's start), depth-first, root first."""
    out: list[tuple[TreeNode, int, int]] = []
    stack: list[tuple[TreeNode, int, int]] = [(root, 0, 0)]
    while stack:
        node, depth, start = stack.pop()
        out.append((node, depth, start))
        end = start + node.key_len  # NOTE: from the key: a hiradix host-only node holds no device slots
        stack += [(c, depth + 1, end) for c in reversed(list(node.children.values()))]
    return out


def preview(node: TreeNode, num_tokens: int) -> str:
    key = node.key
    ids = memoryview(key[: num_tokens * TOKEN_BYTES]).cast("i").tolist()  # NOTE: int32 tokens, as token_ids()
    return " ".join(map(str, ids)) + (" …" if len(key) > num_tokens * TOKEN_BYTES else "")


def export_rows(root: TreeNode, preview_tokens: int = 8) -> list[NodeRow]:
    """NOTE: positional NodeRow fields (a tree snapshot exports every node: it is on the engine's time)."""
    return [
        NodeRow(node.id, None if node.parent is None else node.parent.id, len(node.value),
                preview(node, preview_tokens), node.lock_ref, node.last_access_time, node.hit_count, node.owner,
                node.tombstone, start + len(node.value), node.visibility)
        for node, _, start in walk(root)
    ]


def render(root: TreeNode, preview_tokens: int = 6, extra: Any = None) -> str:
    lines = []
    for node, depth, _ in walk(root):
        if node is root:
            lines.append(f"root [{node.id}]")
            continue
        flags = " tombstone" if node.tombstone else ""
        more = f" {extra(node)}" if extra else ""
        lines.append(
            f"{'  ' * depth}[{node.id}] {node.key_len} tok lock={node.lock_ref} "
            f"hits={node.hit_count}{flags}{more}: {preview(node, preview_tokens)}"
        )
    return "\n".join(lines)
