"""Two-phase eviction of an SWA radix tree (semantics note §5.5).

NOTE: phase 1 frees full KV: the LRU leaf with lock_ref == 0, both halves, then every
tombstone parent left childless and unlocked (full KV only). Phase 2 frees SWA KV, in SWA
LRU order over live nodes with swa_lock_ref == 0: an internal node (or a leaf whose full
KV is locked) gives up its SWA half and becomes a tombstone; an unlocked leaf is deleted
as in phase 1. Phase-1 leaves count toward the SWA target when they were live.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvscope.cache.base import CacheMisuseError
from kvscope.cache.node import TreeNode, walk
from kvscope.telemetry import EventKind, EvictReason, PoolName


class SWAEvictionMixin:
    page_bytes: int
    allocator: Any
    root: TreeNode
    strict: bool
    recorder: Any
    _tree_slot: np.ndarray
    _evictable_size: int
    _protected_size: int
    _swa_evictable_size: int
    _swa_protected_size: int

    _t: Callable[[np.ndarray], torch.Tensor]

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> int:
        """Free >= num_tokens full and >= swa_num_tokens SWA tokens; return full tokens freed."""
        if num_tokens > self._evictable_size or swa_num_tokens > self._swa_evictable_size:
            raise CacheMisuseError(
                f"evict({num_tokens}, swa {swa_num_tokens}) beyond the evictable sizes: full "
                f"{self._evictable_size} (protected {self._protected_size}), swa "
                f"{self._swa_evictable_size} (protected {self._swa_protected_size})"
            )
        full_len, swa_len = self._evict_full(num_tokens) if num_tokens > 0 else (0, 0)
        if swa_len < swa_num_tokens:
            full_len += self._evict_swa(swa_num_tokens - swa_len)
        return full_len

    def _evict_full(self, num_tokens: int) -> tuple[int, int]:
        heap = [(n.last_access_time, n.id, n) for n, _, _ in walk(self.root) if self._is_free_leaf(n)]
        heapq.heapify(heap)
        full_len = swa_len = 0
        while full_len < num_tokens and heap:
            leaf = heapq.heappop(heap)[2]
            swa_len += 0 if leaf.tombstone else len(leaf.value)
            parent, freed_len = self._delete_cascade(leaf)
            full_len += freed_len
            if self._is_free_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return full_len, swa_len

    def _is_free_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and node.lock_ref == 0 and not node.children

    def _evict_swa(self, swa_num_tokens: int) -> int:
        order = sorted(
            (n for n, _, _ in walk(self.root) if n is not self.root and not n.tombstone and n.swa_lock_ref == 0),
            key=lambda n: n.last_access_time,
        )
        full_len = swa_len = 0
        for node in order:
            if swa_len >= swa_num_tokens:
                break
            if node.parent is None or node.tombstone:
                continue
            swa_len += len(node.value)
            if node.children or node.lock_ref > 0:
                self._tombstone(node)
            else:
                full_len += self._delete_cascade(node)[1]
        return full_len

    def _tombstone(self, node: TreeNode) -> None:
        self.allocator.free_swa(self._t(node.value))
        node.tombstone = True
        self._swa_evictable_size -= len(node.value)
        if self.recorder.enabled:
            self.recorder.record(EventKind.TOMBSTONE, pool=PoolName.SWA, node_id=node.id,
                                 num_tokens=len(node.value), slots=node.value, reason=EvictReason.TOMBSTONE)

    def _delete_cascade(self, leaf: TreeNode) -> tuple[TreeNode, int]:
        """Delete an unlocked leaf and the tombstone parents it leaves childless and unlocked."""
        parent = leaf.parent
        assert parent is not None
        freed = [self._delete_leaf(leaf)]
        while parent is not self.root and parent.tombstone and not parent.children and parent.lock_ref == 0:
            up = parent.parent
            assert up is not None
            freed.append(self._delete_leaf(parent))
            parent = up
        values = np.concatenate(freed)
        self.allocator.free(self._t(values))
        return parent, len(values)

    def _delete_leaf(self, leaf: TreeNode) -> np.ndarray:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[leaf.key[: self.page_bytes]]
        leaf.parent = None
        self._evictable_size -= len(leaf.value)
        if not leaf.tombstone:
            self._swa_evictable_size -= len(leaf.value)
        if self.strict:
            self._tree_slot[leaf.value] = False
        if self.recorder.enabled:
            self.recorder.record(EventKind.EVICT, pool=PoolName.FULL, node_id=leaf.id, num_tokens=len(leaf.value),
                                 slots=leaf.value, reason=EvictReason.CAPACITY, aux=int(leaf.tombstone))
        return leaf.value
