"""check_integrity() for SWA radix trees: docs/memory-semantics.md §13 items 5-7.

NOTE: what is checked (IntegrityError with the numbers on the first failure):
    shape       the shared node checks (tree/integrity.py)
    sizes       the four counters equal the sums over the tree
    SWA         no tombstone leaf; lock_ref >= swa_lock_ref >= 0; tombstones have
                swa_lock_ref 0 and mapping 0; live nodes mapping > 0
    LRU         stamps are distinct (one total order); stamps on each root-to-node path
                the last touch refreshed increase with depth
    slots       no slot in two nodes, none on a page the full allocator holds free
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.cache.swa_radix.node import SWANode
from kvscope.cache.tree import check_node_shape, check_sizes, check_tree_slots, walk
from kvscope.mem import IntegrityError

if TYPE_CHECKING:
    from kvscope.cache.swa_radix.cache import SWARadixCache


def check_swa_radix_integrity(cache: SWARadixCache, tree_slot: np.ndarray | None) -> None:
    """`tree_slot`: the strict-mode bitmap of tree slots (None when not strict)."""
    nodes = [(n, start) for n, _, start in walk(cache.root) if n is not cache.root]
    mapping = cache.allocator.full_to_swa_index_mapping.cpu().numpy()
    for node, start in nodes:
        check_node_shape(node, start, cache.page_size)
        check_swa_node(node, mapping)
    check_swa_sizes(cache, [n for n, _ in nodes])
    check_lru(cache, [n for n, _ in nodes])
    check_tree_slots([n.value for n, _ in nodes], cache.allocator.full_attn_allocator, tree_slot)


def check_swa_node(node: SWANode, mapping: np.ndarray) -> None:
    if node.tombstone and not node.children:
        raise IntegrityError(f"tombstone leaf: node {node.id} ({len(node.value)} tokens)")
    if not node.lock_ref >= node.swa_lock_ref >= 0:
        raise IntegrityError(f"node {node.id}: lock_ref {node.lock_ref}, swa_lock_ref {node.swa_lock_ref}")
    swa = mapping[node.value]
    if node.tombstone and (node.swa_lock_ref or (swa != 0).any()):
        raise IntegrityError(
            f"tombstone {node.id}: swa_lock_ref {node.swa_lock_ref}, {int((swa != 0).sum())} of "
            f"{len(swa)} slots still mapped to SWA"
        )
    if not node.tombstone and (swa <= 0).any():
        raise IntegrityError(f"live node {node.id}: {int((swa <= 0).sum())} of {len(swa)} slots lack SWA KV")


def check_swa_sizes(cache: SWARadixCache, nodes: list[SWANode]) -> None:
    live = [n for n in nodes if not n.tombstone]
    found = (
        sum(len(n.value) for n in nodes if n.lock_ref == 0),
        sum(len(n.value) for n in nodes if n.lock_ref > 0),
        sum(len(n.value) for n in live if n.swa_lock_ref == 0),
        sum(len(n.value) for n in live if n.swa_lock_ref > 0),
    )
    said = (cache.evictable_size(), cache.protected_size(), cache.swa_evictable_size(), cache.swa_protected_size())
    check_sizes("full evictable, full protected, swa evictable, swa protected", found, said)


def check_lru(cache: SWARadixCache, nodes: list[SWANode]) -> None:
    stamps = [n.last_access_time for n in nodes]
    if len(set(stamps)) != len(stamps):
        raise IntegrityError(f"LRU stamps not distinct: {len(stamps)} nodes, {len(set(stamps))} stamps")
    # NOTE: no parent-older-than-child rule: as in SGLang, a match stamps only the path to its
    # window cut and a split below it stamps its two pieces, so a node can be older than its
    # parent even on the most recently touched path (docs/memory-semantics.md §5).
