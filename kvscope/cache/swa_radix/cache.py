"""SWARadixCache: SGLang's radix cache for hybrid sliding-window models (docs/memory-semantics.md §5).

NOTE: node values hold FULL-pool slots; the SWA half is `mapping[value]` in the allocator.
    live node       full KV + SWA KV (mapping > 0 for every slot)
    tombstone       full KV only (mapping == 0); never a leaf; swa_lock_ref == 0
Accounting, exact after every call (root excluded):
    full evictable/protected = Σ len(value) over nodes with lock_ref == 0 / > 0
    swa  evictable/protected = Σ len(value) over live nodes with swa_lock_ref == 0 / > 0
LRU: one global counter stamps `last_access_time`; the full LRU is every node by stamp,
the SWA LRU the live nodes by stamp (SGLang 0.5.18 keeps two linked lists in that order).
What stamps, in SGLang's order (docs/memory-semantics.md §5):
    match     the path root -> the node at the window cut (not nodes walked past the cut)
    insert    each node as the walk enters it, then a split's upper and lower piece, then
              each new node as it is added (no path stamp at the end)
    split     upper piece, then lower piece
A window lock (docs/memory-semantics.md §5.2) SWA-locks the deepest nodes up to `window_len` tokens; the node where
the count reaches the window carries `swa_lock_id`, the id that `dec_lock_ref` stops at.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import torch

from kvscope.cache.base import (
    CacheableRequest,
    CacheMisuseError,
    EvictParams,
    EvictResult,
    MatchResult,
    NodeRow,
    SWAPrefixCache,
    as_token_ids,
)
from kvscope.cache.swa_radix.integrity import check_swa_radix_integrity
from kvscope.cache.swa_radix.node import SWANode, is_tombstone, split_swa_node
from kvscope.cache.tree import (
    ROOT_PRIORITY,
    TOKEN_BYTES,
    cache_finished_req,
    cache_unfinished_req,
    claim_slots,
    common_page_len,
    export_rows,
    node_values,
    render,
    slots_tensor,
    up_path,
    walk,
)
from kvscope.cache.tree.node import PageHashMemo, foreign_tokens
from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, swa_window_frontier
from kvscope.telemetry import NULL_RECORDER, EventKind, EvictReason, PoolName, Recorder

INF_LEN = 1 << 62


class SWARadixCache(SWAPrefixCache):
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
        self._page_hash_memo: PageHashMemo = {}  # NOTE: snapshots hash only new or split nodes
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
        self._root = SWANode(now=0.0)
        self._root.lock_ref = self._root.swa_lock_ref = 1
        self._root.priority = ROOT_PRIORITY
        self._evictable_size = self._protected_size = 0
        self._swa_evictable_size = self._swa_protected_size = 0
        self._tree_slot = np.zeros(self.allocator.full_attn_allocator.total_size + 2 * self.page_size, bool)

    @property
    def root(self) -> SWANode:
        return self._root

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def swa_evictable_size(self) -> int:
        return self._swa_evictable_size

    def swa_protected_size(self) -> int:
        return self._swa_protected_size

    def _stamp(self, node: SWANode) -> None:
        node.last_access_time = float(next(self._clock))

    def _stamp_path(self, node: SWANode) -> None:
        """Move node and its ancestors to MRU, each parent just behind its child."""
        for n in reversed(list(up_path(node))):
            self._stamp(n)

    # -- match -----------------------------------------------------------------------------

    def match_prefix(self, token_ids: np.ndarray, user: str | None = None, rid: str | None = None) -> MatchResult:
        ids = as_token_ids(token_ids)
        key = ids[: len(ids) // self.page_size * self.page_size].tobytes()
        values, node = self.walk_match(key)
        slots = slots_tensor(values, self.device)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.MATCH,
                pool=PoolName.FULL,
                rid=rid,
                node_id=node.id,
                num_tokens=len(slots),
                aux=len(ids) - len(slots),
                principal=user,
            )
            cross = foreign_tokens(node, user)
            if cross:
                self.recorder.record(
                    EventKind.CROSS_HIT, pool=PoolName.FULL, rid=rid, node_id=node.id, num_tokens=cross, principal=user
                )
        return MatchResult(slots, node)

    def walk_match(self, key: bytes, user: str | None = None) -> tuple[list[np.ndarray], SWANode]:
        """docs/memory-semantics.md §5.1: the deepest cut whose last >= window tokens all have live SWA KV."""
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
                child = self._split(child, common_page_len(child.key, key, pos, self.page_size))
                pos = end
            else:
                pos += len(child.key)
            values.append(child.value)
            if not child.tombstone:
                since_ts += len(child.value)
            node = child
        if since_ts >= self.window_len:
            best_len, best_node = len(values), node
        self._stamp_path(best_node)
        return values[:best_len], best_node

    def _t(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots).to(self.device)

    def _split(self, child: SWANode, split_len: int) -> SWANode:
        """split_swa_node, then both halves are stamped, upper first (it sits just behind child)."""
        upper = split_swa_node(child, split_len, self.page_bytes, self.recorder)
        self._stamp(upper)
        self._stamp(child)
        return upper

    # -- insert (docs/memory-semantics.md §5.3): duplicates, tombstone revival, new tail ----------------
    # NOTE: insert(ids, slots, prev_prefix_len=p, swa_evicted_len=e); positions of the key:
    #     [0, p)        owned by the tree already (the caller's locked prefix): untouched
    #     [p, e)        the caller's full KV only (its SWA half was freed, window frontier)
    #     [e, key_len)  the caller's full + SWA KV
    # An overlapping node [a, b) with a >= p: live -> free the caller's copy (both halves);
    # tombstone with e <= a -> revive it with the caller's SWA KV; a < e < b -> split at e,
    # the upper part stays a tombstone, the lower part is revived; e >= b -> free the copy.
    # New tail [t, key_len): e >= key_len -> freed, no node; t < e -> tombstone [t, e) then a
    # live leaf [e, key_len); else one live leaf. Unlike RadixCache the insert frees duplicates,
    # each with its own `free` at the node where SGLang frees it (the paged free list's order
    # depends on how frees are grouped, docs/memory-semantics.md §2.4).

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
        node, pos = self._walk_insert(key, value, chunked, priority, prev_prefix_len, evicted_len)
        if pos < key_len:
            self._add_tail(node, key, value, pos, evicted_len, (user, chunked, priority, rid))
        return pos

    def _walk_insert(
        self,
        key: bytes,
        value: np.ndarray,
        chunked: bool,
        priority: int,
        prev_prefix_len: int,
        evicted_len: int,
    ) -> tuple[SWANode, int]:
        node, pos, key_len = self.root, 0, len(value)
        while pos < key_len:
            child = node.children.get(key[pos * TOKEN_BYTES : pos * TOKEN_BYTES + self.page_bytes])
            if child is None:
                break
            self._stamp(child)  # NOTE: as the walk enters it, before any split (SGLang's _insert_helper)
            if priority > child.priority:
                child.priority = priority
            if not key.startswith(child.key, pos * TOKEN_BYTES):
                child = self._split(child, common_page_len(child.key, key, pos * TOKEN_BYTES, self.page_size))
            if not chunked:
                child.hit_count += 1
            end = pos + len(child.value)
            if end > prev_prefix_len:
                child = self._overlap(child, value, pos, end, prev_prefix_len, evicted_len)
            pos = end
            node = child
        return node, pos

    def _overlap(self, node: SWANode, value: np.ndarray, a: int, b: int, p: int, e: int) -> SWANode:
        """Settle the caller's copy of node [a, b); return the node that now ends at b."""
        if not node.tombstone or a < p or e >= b:
            self._free(value[max(a, p) : b])
            return node
        if e > a:  # NOTE: upper [a, e) stays a tombstone; node is now the lower piece [e, b)
            self._split(node, e - a)
            self._revive(node, value[e:b])
            self._free(value[a:e])
            return node
        self._revive(node, value[a:b])
        return node

    def _free(self, slots: np.ndarray) -> None:
        if len(slots):
            self.allocator.free(self._t(slots))

    def _revive(self, node: SWANode, req_slots: np.ndarray) -> None:
        """Give a tombstone the caller's SWA KV; keep its full slots if another holder locks them."""
        assert node.swa_lock_ref == 0, f"tombstone {node.id} has swa_lock_ref {node.swa_lock_ref}"
        req_t, node_t = self._t(req_slots), self._t(node.value)
        if node.lock_ref > 0:
            mapping = self.allocator.full_to_swa_index_mapping
            mapping[node_t] = mapping[req_t]
            mapping[req_t] = 0
            self.allocator.full_attn_allocator.free_now(req_t)  # NOTE: not deferred by a free group (§2.6)
        else:
            self.allocator.free(node_t)
            if self.strict:
                self._tree_slot[node.value] = False
                claim_slots(self._tree_slot, req_slots)
            node.value = req_slots.copy()
        node.tombstone = False
        self._swa_evictable_size += len(node.value)
        if self.recorder.enabled:  # both halves: the node's full slots, then the SWA slots now behind them
            self.recorder.record(
                EventKind.REVIVE, pool=PoolName.FULL, node_id=node.id, num_tokens=len(node.value), slots=node.value
            )
            self.recorder.record(
                EventKind.REVIVE,
                pool=PoolName.SWA,
                node_id=node.id,
                num_tokens=len(node.value),
                slots=self.allocator.translate_loc(self._t(node.value)),
            )

    def _add_tail(
        self,
        node: SWANode,
        key: bytes,
        value: np.ndarray,
        t: int,
        e: int,
        meta: tuple[str | None, bool, int, str | None],
    ) -> SWANode:
        key_len = len(value)
        if e >= key_len:
            self._free(value[t:])
            return node
        if e > t:
            self.allocator.free_swa(self._t(value[t:e]))
            node = self._add_node(node, key[t * TOKEN_BYTES : e * TOKEN_BYTES], value[t:e], True, meta)
            t = e
        return self._add_node(node, key[t * TOKEN_BYTES :], value[t:], False, meta)

    def _add_node(
        self,
        parent: SWANode,
        key: bytes,
        value: np.ndarray,
        tombstone: bool,
        meta: tuple[str | None, bool, int, str | None],
    ) -> SWANode:
        user, chunked, priority, rid = meta
        if self.strict:
            claim_slots(self._tree_slot, value)
        node = SWANode(key, value.copy(), 0.0)
        self._stamp(node)
        node.parent, node.owner, node.priority, node.tombstone = parent, user, priority, tombstone
        node.hit_count = 0 if chunked else 1
        parent.children[key[: self.page_bytes]] = node
        self._evictable_size += len(value)
        if not tombstone:
            self._swa_evictable_size += len(value)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.INSERT,
                pool=PoolName.FULL,
                rid=rid,
                node_id=node.id,
                num_tokens=len(value),
                slots=value,
                aux=parent.id,
                principal=user,
            )
            if tombstone:
                self.recorder.record(
                    EventKind.TOMBSTONE,
                    pool=PoolName.SWA,
                    rid=rid,
                    node_id=node.id,
                    num_tokens=len(value),
                    slots=value,
                    reason=EvictReason.TOMBSTONE,
                )
        return node

    # -- requests (shared bookkeeping in tree/requests.py; docs/memory-semantics.md §5.4) ------

    def cache_unfinished_req(self, req: CacheableRequest, chunked: bool = False) -> None:
        cache_unfinished_req(self, req, chunked)

    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None:
        cache_finished_req(self, req, is_insert)

    def insert_unfinished(
        self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor, chunked: bool
    ) -> int:
        """The insert frees the duplicates; the frontier joins the tree's new range.

        NOTE: while a request prefills, its frontier stays within the tree's range
        (swa_evicted_len <= cache_protected_len): the tree owns the window below the frontier.
        """
        protected = req.cache_protected_len
        if req.swa_evicted_len > protected:
            raise CacheMisuseError(
                f"cache_unfinished_req({req.rid}): SWA frontier {req.swa_evicted_len} beyond the "
                f"protected prefix {protected}; the tree owns the window below the frontier"
            )
        self.insert(token_ids, slots, user=req.user, chunked=chunked, rid=req.rid, prev_prefix_len=protected)
        req.swa_evicted_len = max(req.swa_evicted_len, len(token_ids) // self.page_size * self.page_size)
        return protected

    def insert_finished(self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor) -> int:
        """The insert frees the duplicates; [p, e) goes in with its full KV only."""
        protected = req.cache_protected_len
        self.insert(
            token_ids, slots, user=req.user, rid=req.rid, prev_prefix_len=protected, swa_evicted_len=req.swa_evicted_len
        )
        return protected

    def window_range(self, req: CacheableRequest, pre_len: int) -> tuple[int, int]:
        """Radix rule: the newest max(window, page) tokens keep their SWA KV, and the frontier
        never moves below the tree's range [0, cache_protected_len)."""
        start_len = max(req.swa_evicted_len, req.cache_protected_len)
        keep_len = max(self.window_len, self.page_size)
        return start_len, swa_window_frontier(start_len, pre_len, keep_len, self.page_size)

    # -- locks -----------------------------------------------------------------------------

    def inc_lock_ref(self, node: SWANode, rid: str | None = None) -> int | None:
        """docs/memory-semantics.md §5.2: full-lock node -> root; SWA-lock the deepest `window_len` tokens of it."""
        self._check_window_live(node)
        start, moved, swa_moved, swa_len = node, 0, 0, 0
        lock_id: int | None = None
        for node in up_path(start):
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
        self._move_sizes(-moved, -swa_moved)
        if self.recorder.enabled:
            self.recorder.record(EventKind.LOCK, rid=rid, node_id=start.id, num_tokens=moved, aux=swa_moved)
        return lock_id

    def _check_window_live(self, last: SWANode) -> None:
        swa_len = 0
        for node in up_path(last):
            if swa_len >= self.window_len:
                break
            if node.tombstone:
                raise CacheMisuseError(
                    f"inc_lock_ref: tombstone node {node.id} inside the window ({swa_len} of "
                    f"{self.window_len} live tokens below it)"
                )
            swa_len += len(node.value)

    def dec_lock_ref(
        self, node: SWANode, lock_id: int | None = None, rid: str | None = None, skip_swa: bool = False
    ) -> None:
        if node is not self.root and node.lock_ref <= 0:
            raise CacheMisuseError(f"dec_lock_ref on node {node.id}, which is not locked (lock_ref {node.lock_ref})")
        start, moved, swa_moved, dec_swa = node, 0, 0, not skip_swa
        for node in up_path(start):
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
        self._move_sizes(moved, swa_moved)
        if self.recorder.enabled:
            self.recorder.record(EventKind.UNLOCK, rid=rid, node_id=start.id, num_tokens=moved, aux=swa_moved)

    def _move_sizes(self, to_evictable: int, swa_to_evictable: int) -> None:
        self._evictable_size += to_evictable
        self._protected_size -= to_evictable
        self._swa_evictable_size += swa_to_evictable
        self._swa_protected_size -= swa_to_evictable

    # -- eviction (docs/memory-semantics.md §5.5), two phases ---------------------------------------
    # NOTE: phase 1 frees full KV: the LRU leaf with lock_ref == 0, both halves, then every
    # tombstone parent left childless and unlocked (full KV only). Phase 2 frees SWA KV, in SWA
    # LRU order over live nodes with swa_lock_ref == 0: an internal node (or a leaf whose full
    # KV is locked) gives up its SWA half and becomes a tombstone; an unlocked leaf is deleted
    # as in phase 1. Phase-1 leaves count toward the SWA target when they were live.

    def evict(self, params: EvictParams) -> EvictResult:
        """Free >= num_tokens full and >= swa_num_tokens SWA tokens."""
        return EvictResult(*self._evict_both(params.num_tokens, params.swa_num_tokens))

    def evict_tokens(self, num_tokens: int, swa_num_tokens: int = 0) -> int:
        return self._evict_both(num_tokens, swa_num_tokens)[0]

    def _evict_both(self, num_tokens: int, swa_num_tokens: int) -> tuple[int, int]:
        """(full, SWA) tokens freed. NOTE: the full count includes the tombstone parents a phase-2
        deletion takes with it; SGLang 0.5.18 leaves those out (docs/memory-semantics.md §14.1)."""
        if num_tokens > self._evictable_size or swa_num_tokens > self._swa_evictable_size:
            raise CacheMisuseError(
                f"evict({num_tokens}, swa {swa_num_tokens}) beyond the evictable sizes: full "
                f"{self._evictable_size} (protected {self._protected_size}), swa "
                f"{self._swa_evictable_size} (protected {self._swa_protected_size})"
            )
        full_len, swa_len = self._evict_full(num_tokens) if num_tokens > 0 else (0, 0)
        if swa_len < swa_num_tokens:
            more_full_len, more_swa_len = self._evict_swa(swa_num_tokens - swa_len)
            full_len, swa_len = full_len + more_full_len, swa_len + more_swa_len
        return full_len, swa_len

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

    def _is_free_leaf(self, node: SWANode) -> bool:
        return node is not self.root and node.lock_ref == 0 and not node.children

    def _evict_swa(self, swa_num_tokens: int) -> tuple[int, int]:
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
        return full_len, swa_len

    def _tombstone(self, node: SWANode) -> None:
        self.allocator.free_swa(self._t(node.value))
        node.tombstone = True
        self._swa_evictable_size -= len(node.value)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.TOMBSTONE,
                pool=PoolName.SWA,
                node_id=node.id,
                num_tokens=len(node.value),
                slots=node.value,
                reason=EvictReason.TOMBSTONE,
            )

    def _delete_cascade(self, leaf: SWANode) -> tuple[SWANode, int]:
        """Delete an unlocked leaf and the tombstone parents it leaves childless and unlocked.

        NOTE: one `free` per node, leaf first, as SGLang frees them (at page size > 1 the
        free list's order depends on it)."""
        parent = leaf.parent
        assert parent is not None
        freed_len = self._free_deleted(leaf)
        while parent is not self.root and parent.tombstone and not parent.children and parent.lock_ref == 0:
            up = parent.parent
            assert up is not None
            freed_len += self._free_deleted(parent)
            parent = up
        return parent, freed_len

    def _free_deleted(self, node: SWANode) -> int:
        values = self._delete_leaf(node)
        self.allocator.free(self._t(values))
        return len(values)

    def _delete_leaf(self, leaf: SWANode) -> np.ndarray:
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
            self.recorder.record(
                EventKind.EVICT,
                pool=PoolName.FULL,
                node_id=leaf.id,
                num_tokens=len(leaf.value),
                slots=leaf.value,
                reason=self.evict_reason,
                aux=int(leaf.tombstone),
            )
        return leaf.value

    # -- views -----------------------------------------------------------------------------

    def tree_slots(self) -> np.ndarray:
        return node_values([n for n, _, _ in walk(self.root) if n is not self.root])

    def live_tree_slots(self) -> np.ndarray:
        """Slots of non-tombstone nodes: the full slots whose SWA half the tree owns."""
        return node_values([n for n, _, _ in walk(self.root) if n is not self.root and not n.tombstone])

    def check_integrity(self) -> None:
        check_swa_radix_integrity(self, self._tree_slot if self.strict else None)

    def pretty_print(self) -> str:
        return render(
            self.root, extra=lambda n: f"swa_lock={n.swa_lock_ref} t={n.last_access_time:g}", tombstone=is_tombstone
        )

    def export_nodes(self, preview_tokens: int = 8) -> list[NodeRow]:
        return export_rows(
            self.root, preview_tokens, tombstone=is_tombstone, page_size=self.page_size, memo=self._page_hash_memo
        )
