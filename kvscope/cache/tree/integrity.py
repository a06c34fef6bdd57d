"""The tree invariants both radix families share (docs/memory-semantics.md §13 items 2-6); each cache's
check_integrity() runs these and its own.

NOTE: what is checked (IntegrityError with the numbers on the first failure):
    shape    each node is its parent's child under its first page; key and value lengths
             agree, are whole pages and non-empty; lock_ref >= 0 and >= its children's sum;
             slots page-aligned with their positions
    sizes    a cache's counters equal the sums over the tree
    slots    no slot in two nodes, no padding slot, none on a page the allocator holds
             free; strict: the tree-slot bitmap equals the tree's slots
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Self

import numpy as np

from kvscope.cache.tree.node import TOKEN_BYTES
from kvscope.mem import BaseTokenAllocator, IntegrityError


class ShapedNode(Protocol):
    """A node filed one per first page that holds device slots (the shape check reads these)."""

    id: int
    key: bytes
    lock_ref: int

    @property
    def parent(self) -> Self | None: ...

    @property
    def children(self) -> dict[bytes, Self]: ...

    @property
    def value(self) -> Any: ...


def check_node_shape(node: ShapedNode, start: int, page_size: int) -> None:
    ps = page_size
    parent = node.parent
    if parent is None or parent.children.get(node.key[: ps * TOKEN_BYTES]) is not node:
        raise IntegrityError(f"node {node.id} is not its parent's child under its first page")
    if len(node.key) != TOKEN_BYTES * len(node.value) or not len(node.value) or len(node.value) % ps:
        raise IntegrityError(
            f"node {node.id}: {len(node.key) // TOKEN_BYTES} key tokens, {len(node.value)} slots, page_size {ps}"
        )
    if node.lock_ref < 0:
        raise IntegrityError(f"node {node.id} has lock_ref {node.lock_ref}")
    child_locks = sum(c.lock_ref for c in node.children.values())
    if node.lock_ref < child_locks:
        raise IntegrityError(f"node {node.id}: lock_ref {node.lock_ref} < its children's {child_locks}")
    positions = np.arange(start, start + len(node.value))
    if ps > 1 and (node.value % ps != positions % ps).any():
        raise IntegrityError(f"node {node.id}: slots not page-aligned with their positions")


def check_sizes(what: str, found: Sequence[int], said: Sequence[int]) -> None:
    """`found`: the sums over the tree; `said`: the cache's counters, in the order `what` names."""
    if tuple(found) != tuple(said):
        raise IntegrityError(f"sizes ({what}): tree has {tuple(found)}, counters say {tuple(said)}")


def check_tree_slots(values: list[np.ndarray], allocator: BaseTokenAllocator, tree_slot: np.ndarray | None) -> None:
    """No slot in two nodes, no padding slot, no tree slot on a page `allocator` holds free,
    and (strict, `tree_slot` given) the tree-slot bitmap agrees."""
    slots = np.concatenate(values) if values else np.empty(0, dtype=np.int64)
    uniq, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        raise IntegrityError(f"slots in two tree nodes: {uniq[counts > 1][:16].tolist()}")
    ps = allocator.page_size
    if (slots < ps).any():
        raise IntegrityError("the tree holds a padding slot")
    freed = np.intersect1d(np.unique(slots // ps), allocator.free_page_ids())
    if len(freed):
        raise IntegrityError(f"tree slots on pages the allocator holds free: pages {freed[:16].tolist()}")
    if tree_slot is not None and not np.array_equal(np.flatnonzero(tree_slot), uniq):
        raise IntegrityError("strict slot bitmap disagrees with the tree")
