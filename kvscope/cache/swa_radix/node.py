"""Nodes of the SWA radix tree: a radix node plus its sliding-window state.

NOTE: a node's state on top of TreeNode (docs/memory-semantics.md §5)
    tombstone      full KV only: its SWA half was freed (never a leaf)
    swa_lock_ref   window locks through this node (<= lock_ref; 0 on a tombstone)
    swa_lock_id    set on the node where a window lock reached the window: dec_lock_ref stops there
"""

from __future__ import annotations

import numpy as np

from kvscope.cache.tree import EMPTY_SLOTS, TreeNode, split_node
from kvscope.telemetry import Recorder


class SWANode(TreeNode):
    __slots__ = ("swa_lock_id", "swa_lock_ref", "tombstone")

    def __init__(self, key: bytes = b"", value: np.ndarray = EMPTY_SLOTS, now: float = 0.0) -> None:
        super().__init__(key, value, now)
        self.swa_lock_ref = 0
        self.swa_lock_id: int | None = None
        self.tombstone = False


def split_swa_node(child: SWANode, split_len: int, page_bytes: int, recorder: Recorder) -> SWANode:
    """split_node; both halves keep swa_lock_ref and the tombstone flag, and the upper half takes
    the swa_lock_id (a window lock that ended at child now ends at its upper half)."""
    upper = split_node(child, split_len, page_bytes, recorder)
    upper.swa_lock_ref, upper.tombstone = child.swa_lock_ref, child.tombstone
    upper.swa_lock_id, child.swa_lock_id = child.swa_lock_id, None
    return upper


def is_tombstone(node: SWANode) -> bool:
    return node.tombstone
