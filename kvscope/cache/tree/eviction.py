"""Eviction policies (docs/memory-semantics.md §4.9) and the heap of evictable leaves.

A policy is a small strategy picked once at construction: a key function (smallest is
evicted first) and whether keys only ever grow as a node is used. For such monotone
policies the heap is kept across calls and stale entries are refreshed lazily when they
surface; for the others (mru) it is rebuilt from the evictable leaves at each evict call,
as SGLang does.

NOTE: heap entry = (policy key, tie-break, node id, node). The tie-break is 0, or minus
the leaf's depth in tokens when ties must go to the deeper leaf (page-granular eviction).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvscope.cache.base import CacheMisuseError
from kvscope.cache.tree.node import SlotNode

N = TypeVar("N", bound=SlotNode)


@dataclass(frozen=True)
class EvictionPolicy:
    name: str
    key: Callable[[SlotNode], Any]
    monotone: bool


POLICIES: dict[str, EvictionPolicy] = {
    p.name: p
    for p in (
        EvictionPolicy("lru", lambda n: n.last_access_time, True),
        EvictionPolicy("lfu", lambda n: (n.hit_count, n.last_access_time), True),
        EvictionPolicy("fifo", lambda n: n.creation_time, True),
        EvictionPolicy("mru", lambda n: -n.last_access_time, False),
        EvictionPolicy("filo", lambda n: -n.creation_time, True),
        EvictionPolicy("priority", lambda n: (n.priority, n.last_access_time), True),
        EvictionPolicy("slru", lambda n: (1 if n.hit_count >= 2 else 0, n.last_access_time), True),
    )
}


def get_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise CacheMisuseError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]


def depth_tokens(node: SlotNode) -> int:
    depth = 0
    while node.parent is not None:
        depth += len(node.value)
        node = node.parent
    return depth


class LeafHeap(Generic[N]):
    """Min-heap over evictable leaves with lazy refresh of stale keys."""

    def __init__(self, policy: EvictionPolicy, deeper_first: bool) -> None:
        self.policy = policy
        self.deeper_first = deeper_first
        self.entries: list[tuple[Any, int, int, N]] = []

    def entry(self, node: N) -> tuple[Any, int, int, N]:
        tie = -depth_tokens(node) if self.deeper_first else 0
        return (self.policy.key(node), tie, node.id, node)

    def push(self, node: N) -> None:
        """A node just became an evictable leaf (also mid-evict: a parent whose last child went)."""
        heapq.heappush(self.entries, self.entry(node))

    def start(self, leaves: Collection[N]) -> None:
        """Called at the start of each evict: rebuild when keys are not monotone or the heap bloated."""
        if not self.policy.monotone or len(self.entries) > 4 * len(leaves) + 64:
            self.rebuild(leaves)

    def rebuild(self, leaves: Iterable[N]) -> None:
        self.entries = [self.entry(n) for n in leaves]
        heapq.heapify(self.entries)

    def pop(self, is_evictable_leaf: Callable[[N], bool]) -> N | None:
        """The leaf with the smallest current key, or None when none is left."""
        while self.entries:
            entry = heapq.heappop(self.entries)
            node = entry[3]
            if not is_evictable_leaf(node):
                continue
            current = self.entry(node) if self.deeper_first else (self.policy.key(node), 0, node.id, node)
            if current[:2] != entry[:2]:
                heapq.heappush(self.entries, current)
                continue
            return node
        return None

    def clear(self) -> None:
        self.entries = []
