"""Insert into an SWA radix tree (semantics note §5.3): duplicates, tombstone revival, new tail.

NOTE: insert(ids, slots, prev_prefix_len=p, swa_evicted_len=e); positions of the key:
    [0, p)        owned by the tree already (the caller's locked prefix): untouched
    [p, e)        the caller's full KV only (its SWA half was freed, window frontier)
    [e, key_len)  the caller's full + SWA KV
An overlapping node [a, b) with a >= p: live -> free the caller's copy (both halves);
tombstone with e <= a -> revive it with the caller's SWA KV; a < e < b -> split at e,
the upper part stays a tombstone, the lower part is revived; e >= b -> free the copy.
New tail [t, key_len): e >= key_len -> freed, no node; t < e -> tombstone [t, e) then a
live leaf [e, key_len); else one live leaf. Unlike RadixCache the insert frees duplicates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvscope.cache.base import CacheMisuseError, as_token_ids
from kvscope.cache.node import TOKEN_BYTES, TreeNode, claim_slots
from kvscope.telemetry import EventKind, EvictReason, PoolName


class SWAInsertMixin:
    page_size: int
    page_bytes: int
    allocator: Any
    root: TreeNode
    strict: bool
    recorder: Any
    _tree_slot: np.ndarray
    _evictable_size: int
    _swa_evictable_size: int

    # provided by the cache class
    _split: Callable[[TreeNode, int], TreeNode]
    _common_len: Callable[[bytes, bytes, int], int]
    _stamp_path: Callable[[TreeNode], None]
    _t: Callable[[np.ndarray], torch.Tensor]

    def insert(
        self,
        token_ids: np.ndarray,
        slots: torch.Tensor,
        user: str | None = None,
        chunked: bool = False,
        priority: int = 0,
        rid: str | None = None,
        prev_prefix_len: int = 0,
        swa_evicted_len: int = 0,
    ) -> int:
        ids = as_token_ids(token_ids)
        if len(slots) != len(ids):
            raise CacheMisuseError(f"insert: {len(ids)} token ids but {len(slots)} slots")
        ps = self.page_size
        key_len = len(ids) // ps * ps
        key = ids[:key_len].tobytes()
        value = slots[:key_len].cpu().numpy().astype(np.int64, copy=True)
        evicted_len = -(-swa_evicted_len // ps) * ps
        to_free: list[np.ndarray] = []
        node, pos = self._walk_insert(key, value, chunked, priority, prev_prefix_len, evicted_len, to_free)
        prefix_len = pos
        if pos < key_len:
            node = self._add_tail(node, key, value, pos, evicted_len, to_free, (user, chunked, priority, rid))
        self._stamp_path(node)
        if to_free:
            self.allocator.free(self._t(np.concatenate(to_free)))
        return prefix_len

    def _walk_insert(
        self, key: bytes, value: np.ndarray, chunked: bool, priority: int, prev_prefix_len: int,
        evicted_len: int, to_free: list[np.ndarray],
    ) -> tuple[TreeNode, int]:
        node, pos, key_len = self.root, 0, len(value)
        while pos < key_len:
            child = node.children.get(key[pos * TOKEN_BYTES : pos * TOKEN_BYTES + self.page_bytes])
            if child is None:
                break
            if priority > child.priority:
                child.priority = priority
            if not key.startswith(child.key, pos * TOKEN_BYTES):
                child = self._split(child, self._common_len(child.key, key, pos * TOKEN_BYTES))
            if not chunked:
                child.hit_count += 1
            end = pos + len(child.value)
            if end > prev_prefix_len:
                child = self._overlap(child, value, pos, end, prev_prefix_len, evicted_len, to_free)
            pos += len(child.value)
            node = child
        return node, pos

    def _overlap(
        self, node: TreeNode, value: np.ndarray, a: int, b: int, p: int, e: int, to_free: list[np.ndarray]
    ) -> TreeNode:
        """Settle the caller's copy of node [a, b); return the node the walk continues from."""
        if not node.tombstone or a < p or e >= b:
            to_free.append(value[max(a, p) : b])
            return node
        if e > a:
            upper = self._split(node, e - a)
            to_free.append(value[a:e])
            return upper
        self._revive(node, value[a:b])
        return node

    def _revive(self, node: TreeNode, req_slots: np.ndarray) -> None:
        """Give a tombstone the caller's SWA KV; keep its full slots if another holder locks them."""
        assert node.swa_lock_ref == 0, f"tombstone {node.id} has swa_lock_ref {node.swa_lock_ref}"
        req_t, node_t = self._t(req_slots), self._t(node.value)
        if node.lock_ref > 0:
            mapping = self.allocator.full_to_swa_index_mapping
            mapping[node_t] = mapping[req_t]
            mapping[req_t] = 0
            self.allocator.full_attn_allocator.free(req_t)
        else:
            self.allocator.free(node_t)
            if self.strict:
                self._tree_slot[node.value] = False
                claim_slots(self._tree_slot, req_slots)
            node.value = req_slots.copy()
        node.tombstone = False
        self._swa_evictable_size += len(node.value)
        if self.recorder.enabled:  # both halves: the node's full slots, then the SWA slots now behind them
            self.recorder.record(EventKind.REVIVE, pool=PoolName.FULL, node_id=node.id,
                                 num_tokens=len(node.value), slots=node.value)
            self.recorder.record(EventKind.REVIVE, pool=PoolName.SWA, node_id=node.id, num_tokens=len(node.value),
                                 slots=self.allocator.translate_loc(self._t(node.value)))

    def _add_tail(
        self, node: TreeNode, key: bytes, value: np.ndarray, t: int, e: int, to_free: list[np.ndarray],
        meta: tuple[str | None, bool, int, str | None],
    ) -> TreeNode:
        key_len = len(value)
        if e >= key_len:
            to_free.append(value[t:])
            return node
        if e > t:
            self.allocator.free_swa(self._t(value[t:e]))
            node = self._add_node(node, key[t * TOKEN_BYTES : e * TOKEN_BYTES], value[t:e], True, meta)
            t = e
        return self._add_node(node, key[t * TOKEN_BYTES :], value[t:], False, meta)

    def _add_node(
        self, parent: TreeNode, key: bytes, value: np.ndarray, tombstone: bool,
        meta: tuple[str | None, bool, int, str | None],
    ) -> TreeNode:
        user, chunked, priority, rid = meta
        if self.strict:
            claim_slots(self._tree_slot, value)
        node = TreeNode(key, value.copy(), 0.0)
        node.parent, node.owner, node.priority, node.tombstone = parent, user, priority, tombstone
        node.hit_count = 0 if chunked else 1
        parent.children[key[: self.page_bytes]] = node
        self._evictable_size += len(value)
        if not tombstone:
            self._swa_evictable_size += len(value)
        if self.recorder.enabled:
            self.recorder.record(EventKind.INSERT, pool=PoolName.FULL, rid=rid, node_id=node.id,
                                 num_tokens=len(value), slots=value, aux=parent.id)
            if tombstone:
                self.recorder.record(EventKind.TOMBSTONE, pool=PoolName.SWA, rid=rid, node_id=node.id,
                                     num_tokens=len(value), slots=value, reason=EvictReason.TOMBSTONE)
        return node
