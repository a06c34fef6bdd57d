"""SWARadixCache: SGLang's radix cache for hybrid sliding-window models (semantics note §5).

NOTE: node values hold FULL-pool slots; the SWA half is `mapping[value]` in the allocator.
    live node       full KV + SWA KV (mapping > 0 for every slot)
    tombstone       full KV only (mapping == 0); never a leaf; swa_lock_ref == 0
Accounting, exact after every call (root excluded):
    full evictable/protected = Σ len(value) over nodes with lock_ref == 0 / > 0
    swa  evictable/protected = Σ len(value) over live nodes with swa_lock_ref == 0 / > 0
LRU: one global counter stamps `last_access_time`; the full LRU is every node by stamp,
the SWA LRU the live nodes by stamp. Touching a path stamps it root first, so each parent
sits just behind its child on that path (SWA eviction tombstones from the root side).
A window lock (§5.2) SWA-locks the deepest nodes up to `window_len` tokens; the node where
the count reaches the window carries `swa_lock_id`, the id that `dec_lock_ref` stops at.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from kvscope.cache.base import BasePrefixCache, CacheMisuseError, MatchResult, NodeRow, as_token_ids
from kvscope.cache.node import (
    EMPTY_SLOTS,
    TOKEN_BYTES,
    TreeNode,
    common_page_len,
    export_rows,
    render,
    slots_tensor,
    walk,
)
from kvscope.cache.swa_radix_evict import SWAEvictionMixin
from kvscope.cache.swa_radix_insert import SWAInsertMixin
from kvscope.cache.swa_radix_integrity import check_swa_radix_integrity
from kvscope.cache.swa_radix_requests import SWARequestCachingMixin
from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator
from kvscope.telemetry import NULL_RECORDER, EventKind, PoolName, Recorder

INF_LEN = 1 << 62


class SWARadixCache(SWARequestCachingMixin, SWAInsertMixin, SWAEvictionMixin, BasePrefixCache):
    def __init__(
        self,
        allocator: SWATokenToKVPoolAllocator,
        page_size: int = 1,
        *,
        window_len: int,
        req_to_token_pool: ReqToTokenPool | None = None,
        recorder: Recorder = NULL_RECORDER,
        strict: bool = False,
    ) -> None:
        if page_size != allocator.page_size:
            raise CacheMisuseError(f"page_size {page_size} != the allocator's {allocator.page_size}")
        if window_len < 1:
            raise CacheMisuseError(f"window_len must be >= 1, got {window_len}")
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.window_len = window_len
        self.device = allocator.device
        self.recorder = recorder
        self.strict = strict
        self.reset()

    def reset(self) -> None:
        """Forget the tree (the caller clears the allocator too, as flush_cache does)."""
        self._clock = itertools.count(1)
        self._lock_ids = itertools.count(1)
        self.root = TreeNode(now=0.0)
        self.root.lock_ref = self.root.swa_lock_ref = 1
        self.root.priority = -(2**62)
        self._evictable_size = self._protected_size = 0
        self._swa_evictable_size = self._swa_protected_size = 0
        self._tree_slot = np.zeros(self.allocator.full_attn_allocator.total_size + 2 * self.page_size, bool)

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def swa_evictable_size(self) -> int:
        return self._swa_evictable_size

    def swa_protected_size(self) -> int:
        return self._swa_protected_size

    def _stamp(self, node: TreeNode) -> None:
        node.last_access_time = float(next(self._clock))

    def _stamp_path(self, node: TreeNode) -> None:
        """Move node and its ancestors to MRU, each parent just behind its child."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        for n in reversed(path):
            self._stamp(n)

    # -- match -----------------------------------------------------------------------------

    def match_prefix(
        self, token_ids: np.ndarray, user: str | None = None, rid: str | None = None
    ) -> MatchResult:
        ids = as_token_ids(token_ids)
        key = ids[: len(ids) // self.page_size * self.page_size].tobytes()
        values, node = self._walk_match(key)
        slots = self._to_tensor(values)
        if self.recorder.enabled:
            self.recorder.record(EventKind.MATCH, pool=PoolName.FULL, rid=rid, node_id=node.id,
                                 num_tokens=len(slots), aux=len(ids) - len(slots))
        return MatchResult(slots, node)

    def _walk_match(self, key: bytes) -> tuple[list[np.ndarray], TreeNode]:
        """§5.1: the deepest cut whose last >= window tokens all have live SWA KV."""
        node = self.root
        values: list[np.ndarray] = []
        since_ts, best_len, best_node = INF_LEN, 0, self.root
        pos, end, page_bytes = 0, len(key), self.page_bytes
        while pos < end:
            child = node.children.get(key[pos : pos + page_bytes])
            if child is None:
                break
            if child.tombstone:
                if since_ts >= self.window_len:
                    best_len, best_node = len(values), node
                since_ts = 0
            if not key.startswith(child.key, pos):
                child = self._split(child, self._common_len(child.key, key, pos))
                pos = end
            else:
                pos += len(child.key)
            values.append(child.value)
            if not child.tombstone:
                since_ts += len(child.value)
            node = child
        if since_ts >= self.window_len:
            best_len, best_node = len(values), node
        self._stamp_path(node)
        return values[:best_len], best_node

    def _common_len(self, node_key: bytes, key: bytes, pos: int) -> int:
        return common_page_len(node_key, key, pos, self.page_size)

    def _to_tensor(self, values: list[np.ndarray]) -> torch.Tensor:
        return slots_tensor(values, self.device)

    def _t(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots).to(self.device)

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after split_len tokens; the new upper node takes its place.

        NOTE: both halves keep both lock refs and the tombstone flag; the upper half takes
        the swa_lock_id (a window lock that ended at child now ends at its upper half).
        """
        parent = child.parent
        assert parent is not None
        cut = split_len * TOKEN_BYTES
        upper = TreeNode(child.key[:cut], child.value[:split_len], child.last_access_time)
        upper.parent, upper.lock_ref, upper.swa_lock_ref = parent, child.lock_ref, child.swa_lock_ref
        upper.hit_count, upper.priority, upper.owner = child.hit_count, child.priority, child.owner
        upper.creation_time, upper.tombstone = child.creation_time, child.tombstone
        upper.swa_lock_id, child.swa_lock_id = child.swa_lock_id, None
        child.key, child.value, child.parent = child.key[cut:], child.value[split_len:], upper
        upper.children[child.key[: self.page_bytes]] = child
        parent.children[upper.key[: self.page_bytes]] = upper
        self._stamp(upper)
        self._stamp(child)
        if self.recorder.enabled:
            self.recorder.record(EventKind.SPLIT, node_id=upper.id, num_tokens=split_len, aux=child.id)
        return upper

    # -- locks -----------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode, rid: str | None = None) -> int | None:
        """§5.2: full-lock node -> root; SWA-lock the deepest `window_len` tokens of it."""
        self._check_window_live(node)
        start, moved, swa_moved, swa_len = node, 0, 0, 0
        lock_id: int | None = None
        while node is not self.root:
            if node.lock_ref == 0:
                moved += len(node.value)
            node.lock_ref += 1
            if swa_len < self.window_len:
                if node.swa_lock_ref == 0:
                    swa_moved += len(node.value)
                node.swa_lock_ref += 1
                swa_len += len(node.value)
                if swa_len >= self.window_len:
                    if node.swa_lock_id is None:
                        node.swa_lock_id = next(self._lock_ids)
                    lock_id = node.swa_lock_id
            node = node.parent  # type: ignore[assignment]
        self._move_sizes(-moved, -swa_moved)
        if self.recorder.enabled:
            self.recorder.record(EventKind.LOCK, rid=rid, node_id=start.id, num_tokens=moved, aux=swa_moved)
        return lock_id

    def _check_window_live(self, node: TreeNode) -> None:
        swa_len = 0
        while node is not self.root and swa_len < self.window_len:
            if node.tombstone:
                raise CacheMisuseError(
                    f"inc_lock_ref: tombstone node {node.id} inside the window ({swa_len} of "
                    f"{self.window_len} live tokens below it)"
                )
            swa_len += len(node.value)
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode, lock_id: int | None = None, rid: str | None = None,
                     skip_swa: bool = False) -> None:
        if node is not self.root and node.lock_ref <= 0:
            raise CacheMisuseError(f"dec_lock_ref on node {node.id}, which is not locked (lock_ref {node.lock_ref})")
        start, moved, swa_moved, dec_swa = node, 0, 0, not skip_swa
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += len(node.value)
            if dec_swa:
                if node.tombstone or node.swa_lock_ref <= 0:
                    raise CacheMisuseError(
                        f"dec_lock_ref: node {node.id} in the window is not SWA-locked "
                        f"(swa_lock_ref {node.swa_lock_ref}, tombstone {node.tombstone})"
                    )
                node.swa_lock_ref -= 1
                if node.swa_lock_ref == 0:
                    swa_moved += len(node.value)
                if lock_id is not None and node.swa_lock_id == lock_id:
                    dec_swa = False
            node = node.parent  # type: ignore[assignment]
        self._move_sizes(moved, swa_moved)
        if self.recorder.enabled:
            self.recorder.record(EventKind.UNLOCK, rid=rid, node_id=start.id, num_tokens=moved, aux=swa_moved)

    def _move_sizes(self, to_evictable: int, swa_to_evictable: int) -> None:
        self._evictable_size += to_evictable
        self._protected_size -= to_evictable
        self._swa_evictable_size += swa_to_evictable
        self._swa_protected_size -= swa_to_evictable

    # -- views -----------------------------------------------------------------------------

    def tree_slots(self) -> np.ndarray:
        values = [n.value for n, _, _ in walk(self.root) if n is not self.root]
        return np.concatenate(values) if values else EMPTY_SLOTS

    def live_tree_slots(self) -> np.ndarray:
        """Slots of non-tombstone nodes: the full slots whose SWA half the tree owns."""
        values = [n.value for n, _, _ in walk(self.root) if n is not self.root and not n.tombstone]
        return np.concatenate(values) if values else EMPTY_SLOTS

    def check_integrity(self) -> None:
        check_swa_radix_integrity(self)

    def pretty_print(self) -> str:
        return render(self.root, extra=lambda n: f"swa_lock={n.swa_lock_ref} t={n.last_access_time:g}")

    def export_nodes(self, preview_tokens: int = 8) -> list[NodeRow]:
        return export_rows(self.root, preview_tokens)
