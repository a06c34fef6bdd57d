"""check_integrity() for radix trees: every invariant of semantics note §13 items 2-6."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.cache.node import TOKEN_BYTES, walk
from kvscope.mem import IntegrityError


def check_node_shape(cache: Any, node: Any, start: int) -> None:
    ps = cache.page_size
    parent = node.parent
    if parent is None or parent.children.get(node.key[: cache.page_bytes]) is not node:
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


def check_radix_integrity(cache: Any) -> None:
    nodes = [(n, start) for n, _, start in walk(cache.root) if n is not cache.root]
    for node, start in nodes:
        check_node_shape(cache, node, start)
    evictable = sum(len(n.value) for n, _ in nodes if n.lock_ref == 0)
    protected = sum(len(n.value) for n, _ in nodes if n.lock_ref > 0)
    if (evictable, protected) != (cache.evictable_size(), cache.protected_size()):
        raise IntegrityError(
            f"sizes: tree has evictable {evictable}, protected {protected}; counters say "
            f"{cache.evictable_size()}, {cache.protected_size()}"
        )
    leaves = {n for n, _ in nodes if n.lock_ref == 0 and not n.children}
    if leaves != cache.evictable_leaves:
        raise IntegrityError(
            f"evictable leaves: tree has {sorted(n.id for n in leaves)}, "
            f"the set has {sorted(n.id for n in cache.evictable_leaves)}"
        )
    check_tree_slots(cache, [n.value for n, _ in nodes], cache.allocator)


def check_tree_slots(cache: Any, values: list[np.ndarray], allocator: Any) -> None:
    """No slot in two nodes, no padding slot, no tree slot on a page `allocator` holds free,
    and (strict) the tree-slot bitmap agrees."""
    slots = np.concatenate(values) if values else np.empty(0, dtype=np.int64)
    uniq, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        raise IntegrityError(f"slots in two tree nodes: {uniq[counts > 1][:16].tolist()}")
    ps = cache.page_size
    if (slots < ps).any():
        raise IntegrityError("the tree holds a padding slot")
    free_pages = allocator._all_free_pages_np()
    freed = np.intersect1d(np.unique(slots // ps), free_pages)
    if len(freed):
        raise IntegrityError(f"tree slots on pages the allocator holds free: pages {freed[:16].tolist()}")
    if cache.strict and not np.array_equal(np.flatnonzero(cache._tree_slot), uniq):
        raise IntegrityError("strict slot bitmap disagrees with the tree")
