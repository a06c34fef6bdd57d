"""LockedTree: the machinery every single-pool radix family holds (the radix, scoped and
two-tier trees): lock/unlock path accounting, the evictable/protected token counts, the
evictable-leaf set and its heap, deleting and trimming a leaf, strict slot claims, and the
eviction loop. It reads and writes nodes; the family decides what a node is, how children
are filed and what an eviction does to a leaf.

NOTE: accounting, exact after every call (the family's check_integrity checks it):
    evictable_len = Σ len(value) over counted nodes with lock_ref == 0 (root excluded)
    protected_len = Σ len(value) over counted nodes with lock_ref  > 0 (root excluded)
    evictable leaves = counted nodes with lock_ref == 0 for which the family's `is_leaf` holds
Counted nodes are those holding device slots (a two-tier tree's host-only nodes are not).
How children are filed is the family's: `detach(leaf)` takes a leaf out of its parent's
children (one child per first page, or a list of copies), `is_leaf(node)` says whether an
unlocked node is an evictable leaf (no children; no device child; not a tombstone ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from kvscope.cache.base import CacheMisuseError
from kvscope.cache.tree.eviction import EvictionPolicy, LeafHeap
from kvscope.cache.tree.integrity import check_sizes, check_tree_slots
from kvscope.cache.tree.node import TOKEN_BYTES, SlotNode, claim_slots
from kvscope.mem import BaseTokenAllocator, IntegrityError

N = TypeVar("N", bound=SlotNode)
ROOT_PRIORITY = -(2**62)


def check_tree_options(allocator: BaseTokenAllocator, page_size: int, eviction_granularity: str) -> None:
    if page_size != allocator.page_size:
        raise CacheMisuseError(f"page_size {page_size} != the allocator's {allocator.page_size}")
    if eviction_granularity not in ("leaf", "page"):
        raise CacheMisuseError(f"eviction_granularity must be 'leaf' or 'page', got {eviction_granularity!r}")


class LockedTree(Generic[N]):
    def __init__(
        self,
        root: N,
        allocator: BaseTokenAllocator,
        policy: EvictionPolicy,
        *,
        deeper_first: bool,
        strict: bool,
        detach: Callable[[N], None],
        is_leaf: Callable[[N], bool],
    ) -> None:
        root.lock_ref = 1
        root.priority = ROOT_PRIORITY
        self.root = root
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.strict = strict
        self.detach = detach
        self.is_leaf = is_leaf
        self.evictable_len = 0
        self.protected_len = 0
        self.evictable_leaves: set[N] = set()
        self.heap: LeafHeap[N] = LeafHeap(policy, deeper_first)
        self.tree_slot = np.zeros(allocator.total_size + 2 * self.page_size, dtype=bool)  # NOTE: strict only

    # -- leaves ----------------------------------------------------------------------------

    def mark_leaf(self, node: N) -> None:
        """Put `node` in the evictable leaves if it now qualifies."""
        if node.lock_ref == 0 and node is not self.root and self.is_leaf(node):
            self.evictable_leaves.add(node)
            self.heap.push(node)

    def claim(self, value: np.ndarray) -> None:
        """Strict: `value` becomes tree slots; refuses (CacheMisuseError) a slot the tree holds.
        The family claims before it changes the tree, so a refused insert changes nothing."""
        if self.strict:
            claim_slots(self.tree_slot, value)

    def count_new(self, parent: N, node: N, value: np.ndarray) -> None:
        """`node` (filed under `parent` by the family) now holds the claimed device slots
        `value`: count them and settle the leaf set of both."""
        if node.lock_ref == 0:
            self.evictable_len += len(value)
        else:
            self.protected_len += len(value)
        self.evictable_leaves.discard(parent)
        self.mark_leaf(node)

    def delete_leaf(self, leaf: N) -> np.ndarray:
        """Take an unlocked leaf out of the tree; returns its slots (the caller frees them)."""
        parent = leaf.parent
        assert parent is not None
        self.detach(leaf)
        leaf.parent = None
        self.evictable_leaves.discard(leaf)
        self.evictable_len -= len(leaf.value)
        self.release(leaf.value)
        self.mark_leaf(parent)
        return leaf.value

    def trim_leaf(self, leaf: N, num_tokens: int) -> np.ndarray:
        """Cut the last `num_tokens` (whole pages) off an unlocked leaf; returns them (the caller frees)."""
        chunk = leaf.value[-num_tokens:]
        leaf.value = leaf.value[:-num_tokens]
        leaf.key = leaf.key[: -num_tokens * TOKEN_BYTES]
        self.evictable_len -= num_tokens
        self.release(chunk)
        self.heap.push(leaf)
        return chunk

    def release(self, slots: np.ndarray) -> None:
        """Strict: `slots` are no longer tree slots."""
        if self.strict:
            self.tree_slot[slots] = False

    # -- locks -----------------------------------------------------------------------------

    def lock(self, node: N) -> int:
        """+1 lock_ref from `node` up to the root; returns the tokens that became protected."""
        root, leaves, moved = self.root, self.evictable_leaves, 0
        up: Any = node  # NOTE: the hot path: no None check per step (only the root has no parent)
        while up is not root:
            if up.lock_ref == 0:
                moved += len(up.value)
                leaves.discard(up)
            up.lock_ref += 1
            up = up.parent
        self.evictable_len -= moved
        self.protected_len += moved
        return moved

    def unlock(self, node: N) -> int:
        """-1 lock_ref from `node` up to the root; returns the tokens that became evictable."""
        root, moved = self.root, 0
        if node is not root and node.lock_ref <= 0:
            raise CacheMisuseError(f"dec_lock_ref on node {node.id}, which is not locked (lock_ref {node.lock_ref})")
        up: Any = node
        while up is not root:
            up.lock_ref -= 1
            if up.lock_ref == 0:
                moved += len(up.value)
                self.mark_leaf(up)
            up = up.parent
        self.evictable_len += moved
        self.protected_len -= moved
        return moved

    # -- eviction --------------------------------------------------------------------------

    def check_evictable(self, num_tokens: int, swa_num_tokens: int) -> None:
        if num_tokens > self.evictable_len or swa_num_tokens > 0:
            raise CacheMisuseError(
                f"evict({num_tokens}, swa {swa_num_tokens}) beyond the evictable size "
                f"{self.evictable_len} (protected {self.protected_len}; a radix cache holds no SWA KV)"
            )

    def evict_leaves(self, num_tokens: int, take: Callable[[N, int], np.ndarray | None]) -> list[np.ndarray]:
        """Leaves in policy order until `num_tokens` are freed: `take(leaf, want)` evicts one
        (`want`: the tokens still wanted, in whole pages) and returns the device slots it freed,
        or None when that leaf cannot go now. Returns the freed slot arrays (the caller frees)."""
        freed: list[np.ndarray] = []
        if num_tokens <= 0:
            return freed
        self.heap.start(self.evictable_leaves)
        evicted = 0
        while evicted < num_tokens:
            leaf = self.heap.pop(self.evictable_leaves.__contains__)
            if leaf is None:
                break
            chunk = take(leaf, -(-(num_tokens - evicted) // self.page_size) * self.page_size)
            if chunk is not None:
                freed.append(chunk)
                evicted += len(chunk)
        return freed

    # -- invariants ------------------------------------------------------------------------

    def check(self, counted: list[N]) -> None:
        """The counts and the leaf set equal the sums over `counted` (every counted node but the
        root), and (no slot twice, none free, strict bitmap) their slots are the tree's."""
        evictable = sum(len(n.value) for n in counted if n.lock_ref == 0)
        protected = sum(len(n.value) for n in counted if n.lock_ref > 0)
        check_sizes("evictable, protected", (evictable, protected), (self.evictable_len, self.protected_len))
        leaves = {n for n in counted if n.lock_ref == 0 and self.is_leaf(n)}
        if leaves != self.evictable_leaves:
            raise IntegrityError(
                f"evictable leaves: tree has {sorted(n.id for n in leaves)}, "
                f"the set has {sorted(n.id for n in self.evictable_leaves)}"
            )
        check_tree_slots([n.value for n in counted], self.allocator, self.tree_slot if self.strict else None)


class PageFiledTree(LockedTree[N]):
    """The plain radix tree's LockedTree: children filed one per first page, an unlocked node
    without children is an evictable leaf. Same behaviour as LockedTree told so by callbacks;
    the hot paths (a new leaf, a whole-leaf eviction) test and detach inline, as the per-node
    callbacks cost 10-20% of an eviction (benchmarks/bench_radix.py)."""

    def __init__(
        self, root: N, allocator: BaseTokenAllocator, policy: EvictionPolicy, *, deeper_first: bool, strict: bool
    ) -> None:
        self.page_bytes = allocator.page_size * TOKEN_BYTES
        super().__init__(
            root,
            allocator,
            policy,
            deeper_first=deeper_first,
            strict=strict,
            detach=self._detach_child,
            is_leaf=self._childless,
        )

    def _detach_child(self, leaf: Any) -> None:
        del leaf.parent.children[leaf.key[: self.page_bytes]]

    @staticmethod
    def _childless(node: Any) -> bool:
        return not node.children

    def mark_leaf(self, node: Any) -> None:
        if node.lock_ref == 0 and not node.children and node is not self.root:
            self.evictable_leaves.add(node)
            self.heap.push(node)

    def count_new(self, parent: N, node: Any, value: np.ndarray) -> None:
        if node.lock_ref == 0:
            self.evictable_len += len(value)
            self.evictable_leaves.discard(parent)
            if not node.children:
                self.evictable_leaves.add(node)
                self.heap.push(node)
            return
        self.protected_len += len(value)
        self.evictable_leaves.discard(parent)

    def evict_whole_leaves(self, num_tokens: int) -> list[np.ndarray]:
        """`evict_leaves` with every leaf taken whole by `delete_leaf`, in one loop."""
        freed: list[np.ndarray] = []
        if num_tokens <= 0:
            return freed
        heap, leaves, root, page_bytes = self.heap, self.evictable_leaves, self.root, self.page_bytes
        heap.start(leaves)
        pop, is_leaf, tree_slot = heap.pop, leaves.__contains__, self.tree_slot if self.strict else None
        evicted = 0
        while evicted < num_tokens:
            leaf: Any = pop(is_leaf)
            if leaf is None:
                break
            parent, value = leaf.parent, leaf.value
            del parent.children[leaf.key[:page_bytes]]
            leaf.parent = None
            leaves.discard(leaf)
            if tree_slot is not None:
                tree_slot[value] = False
            if parent.lock_ref == 0 and not parent.children and parent is not root:
                leaves.add(parent)
                heap.push(parent)
            freed.append(value)
            evicted += len(value)
        self.evictable_len -= evicted
        return freed
