"""The two-tier radix node (docs/memory-semantics.md §4.2, §7) and its split.

NOTE: a node's tier follows from its two slot arrays:
    value        host_value   tier
    set          None         device          (device-only)
    set          set          device+host     (backed up)
    None         set          host            (host-only, "evicted")
`value` holds device slots, `host_value` host slots, one per key token each. In-flight
copies: `write_op` / `load_op` name the controller operation that is copying this node's
KV (the upper half of a split shares its lower half's op); `host_ref_counter` pins the host
copy while a load reads it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from kvscope.cache.tree import TOKEN_BYTES, NodeBase, walk
from kvscope.telemetry import EventKind, Recorder

Tier = Literal["device", "device+host", "host"]


class HiTreeNode(NodeBase):
    __slots__ = ("children", "host_ref_counter", "host_value", "load_op", "value", "write_op")

    def __init__(
        self, key: bytes = b"", value: np.ndarray | None = None, now: float = 0.0, host_value: np.ndarray | None = None
    ) -> None:
        super().__init__(key, now)
        self.children: dict[bytes, HiTreeNode] = {}
        self.value = value
        self.host_value = host_value
        self.host_ref_counter = 0
        self.write_op: int | None = None
        self.load_op: int | None = None

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backed_up(self) -> bool:
        return self.host_value is not None

    @property
    def tier(self) -> Tier:
        if self.value is None:
            return "host"
        return "device" if self.host_value is None else "device+host"

    def device_children(self) -> list[HiTreeNode]:
        return [c for c in self.children.values() if c.value is not None]

    def device_node(self) -> HiTreeNode:
        """This node, or its nearest ancestor on the device tier (the root at the latest)."""
        node = self
        while node.value is None:
            assert node.parent is not None
            node = node.parent
        return node

    def backed_up_node(self) -> HiTreeNode:
        """This node, or its nearest backed-up ancestor (the root at the latest)."""
        node = self
        while node.host_value is None:
            assert node.parent is not None
            node = node.parent
        return node

    def __repr__(self) -> str:
        return f"HiTreeNode(id={self.id}, tokens={self.key_len}, tier={self.tier}, lock_ref={self.lock_ref})"


def split_hi_node(child: HiTreeNode, split_len: int, page_bytes: int, recorder: Recorder) -> HiTreeNode:
    """Cut `child` after split_len tokens on both tiers; the new upper node takes its place.

    NOTE: as tree.split_node: both halves keep lock_ref, hit_count, priority and owner; the
    upper half is new (created at the split, SGLang's `_split_node`). Here both halves
    also keep host_ref_counter and the in-flight op ids (the caller adds the upper half to
    those ops).
    """
    parent = child.parent
    assert parent is not None
    cut = split_len * TOKEN_BYTES
    upper_value = None if child.value is None else child.value[:split_len]
    upper_host = None if child.host_value is None else child.host_value[:split_len]
    upper = HiTreeNode(child.key[:cut], upper_value, child.last_access_time, upper_host)
    upper.parent, upper.lock_ref, upper.hit_count = parent, child.lock_ref, child.hit_count
    upper.priority, upper.owner = child.priority, child.owner
    upper.host_ref_counter = child.host_ref_counter
    upper.write_op, upper.load_op = child.write_op, child.load_op
    child.key, child.parent = child.key[cut:], upper
    if child.value is not None:
        child.value = child.value[split_len:]
    if child.host_value is not None:
        child.host_value = child.host_value[split_len:]
    upper.children[child.key[:page_bytes]] = child
    parent.children[upper.key[:page_bytes]] = upper
    if recorder.enabled:
        recorder.record(EventKind.SPLIT, node_id=upper.id, num_tokens=split_len, aux=child.id)
    return upper


def hi_walk(root: HiTreeNode) -> list[tuple[HiTreeNode, int, int]]:
    """tree.walk over a two-tier tree (lengths come from the keys, so host-only nodes count)."""
    return walk(root)


def is_device_leaf(node: HiTreeNode) -> bool:
    """An unlocked node is an evictable leaf when it holds device slots and no child does."""
    return node.value is not None and not any(c.value is not None for c in node.children.values())
