"""check_integrity() for SWA radix trees: semantics note §13 items 5-7.

NOTE: what is checked (IntegrityError with the numbers on the first failure):
    shape       key/value lengths, whole pages, child keys, page alignment, lock_ref >= children's
    sizes       the four counters equal the sums over the tree
    SWA         no tombstone leaf; lock_ref >= swa_lock_ref >= 0; tombstones have
                swa_lock_ref 0 and mapping 0; live nodes mapping > 0
    LRU         stamps are distinct (one total order); stamps on each root-to-node path
                the last touch refreshed increase with depth
    slots       no slot in two nodes, none on a page the full allocator holds free
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.cache.node import walk
from kvscope.cache.radix_integrity import check_node_shape, check_tree_slots
from kvscope.mem import IntegrityError


def check_swa_radix_integrity(cache: Any) -> None:
    nodes = [(n, start) for n, _, start in walk(cache.root) if n is not cache.root]
    mapping = cache.allocator.full_to_swa_index_mapping.cpu().numpy()
    for node, start in nodes:
        check_node_shape(cache, node, start)
        check_swa_node(node, mapping)
    check_sizes(cache, [n for n, _ in nodes])
    check_lru(cache, [n for n, _ in nodes])
    check_tree_slots(cache, [n.value for n, _ in nodes], cache.allocator.full_attn_allocator)


def check_swa_node(node: Any, mapping: np.ndarray) -> None:
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


def check_sizes(cache: Any, nodes: list[Any]) -> None:
    live = [n for n in nodes if not n.tombstone]
    found = (
        sum(len(n.value) for n in nodes if n.lock_ref == 0),
        sum(len(n.value) for n in nodes if n.lock_ref > 0),
        sum(len(n.value) for n in live if n.swa_lock_ref == 0),
        sum(len(n.value) for n in live if n.swa_lock_ref > 0),
    )
    said = (cache.evictable_size(), cache.protected_size(), cache.swa_evictable_size(), cache.swa_protected_size())
    if found != said:
        raise IntegrityError(
            f"sizes (full evictable, full protected, swa evictable, swa protected): tree has {found}, "
            f"counters say {said}"
        )


def check_lru(cache: Any, nodes: list[Any]) -> None:
    stamps = [n.last_access_time for n in nodes]
    if len(set(stamps)) != len(stamps):
        raise IntegrityError(f"LRU stamps not distinct: {len(stamps)} nodes, {len(set(stamps))} stamps")
    if not nodes:
        return
    newest = max(nodes, key=lambda n: n.last_access_time)
    node = newest
    while node.parent is not cache.root:
        if node.parent.last_access_time >= node.last_access_time:
            raise IntegrityError(
                f"LRU: on the last touched path, parent {node.parent.id} (t={node.parent.last_access_time}) "
                f"is not older than child {node.id} (t={node.last_access_time})"
            )
        node = node.parent
