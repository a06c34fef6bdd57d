"""RadixCache: SGLang's page-aware radix prefix cache (docs/memory-semantics.md §4), slot for slot.

NOTE: tree accounting, kept exact after every call by the LockedTree it holds (tree/core.py):
    evictable_size = Σ len(value) over nodes with lock_ref == 0 (root excluded)
    protected_size = Σ len(value) over nodes with lock_ref  > 0 (root excluded)
    evictable leaves = nodes with lock_ref == 0 and no children
Keys are whole pages: a child is keyed by the bytes of its first page, matches are
truncated to a multiple of page_size, and position i of a path sits at a slot with
slot % page_size == i % page_size.

Named option `eviction_granularity`: "leaf" (SGLang's default: whole leaves, may
overshoot) or "page" (kvscope's: only as many pages as needed, from the tail of the
coldest leaf, ties to the deeper leaf; this makes one-pass hit-rate curves exact).
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
import torch

from kvscope.cache.base import (
    TOKEN_DTYPE,
    BasePrefixCache,
    CacheableRequest,
    CacheMisuseError,
    EvictParams,
    EvictResult,
    MatchResult,
    NodeRow,
    as_token_ids,
    page_key,
)
from kvscope.cache.tree import (
    TOKEN_BYTES,
    PageFiledTree,
    TreeNode,
    cache_finished_req,
    cache_unfinished_req,
    check_node_shape,
    check_tree_options,
    common_page_len,
    export_rows,
    get_policy,
    node_values,
    render,
    split_node,
    walk,
)
from kvscope.cache.tree.node import PageHashMemo, foreign_tokens
from kvscope.mem import BaseTokenAllocator, ReqToTokenPool
from kvscope.telemetry import NULL_RECORDER, EventKind, PoolName, Recorder


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        allocator: BaseTokenAllocator,
        page_size: int = 1,
        *,
        req_to_token_pool: ReqToTokenPool | None = None,
        eviction_policy: str = "lru",
        eviction_granularity: Literal["leaf", "page"] = "leaf",
        recorder: Recorder = NULL_RECORDER,
        strict: bool = False,
    ) -> None:
        check_tree_options(allocator, page_size, eviction_granularity)
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self._page_hash_memo: PageHashMemo = {}  # NOTE: snapshots hash only new or split nodes
        self.page_bytes = page_size * TOKEN_BYTES
        self.device = allocator.device
        self._on_cpu = self.device.type == "cpu"
        self._no_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        self.policy = get_policy(eviction_policy)
        self.eviction_granularity = eviction_granularity
        # NOTE: SGLang stamps a split node's unmatched lower piece as accessed; page mode does
        # not, so one recency order describes the tree and hit-rate curves are exact
        self._page_granular = eviction_granularity == "page"
        self.recorder = recorder
        self.strict = strict
        self.reset()

    def reset(self) -> None:
        """Forget the tree (the caller clears the allocator too, as flush_cache does)."""
        root = TreeNode(now=time.monotonic())
        self.tree = PageFiledTree(
            root, self.allocator, self.policy, deeper_first=self._page_granular, strict=self.strict
        )

    @property
    def root(self) -> TreeNode:
        return self.tree.root

    def evictable_size(self) -> int:
        return self.tree.evictable_len

    def protected_size(self) -> int:
        return self.tree.protected_len

    def total_size(self) -> int:
        return self.tree.evictable_len + self.tree.protected_len

    # -- match -----------------------------------------------------------------------------

    def match_prefix(self, token_ids: np.ndarray, user: str | None = None, rid: str | None = None) -> MatchResult:
        # NOTE: the hot path: helpers are inlined here (as_token_ids, page_key, slots_tensor)
        ids = token_ids if type(token_ids) is np.ndarray and token_ids.dtype == TOKEN_DTYPE else as_token_ids(token_ids)
        key_len = len(ids) - len(ids) % self.page_size
        values, node = self.walk_match((ids if key_len == len(ids) else ids[:key_len]).tobytes())
        if not values:
            slots = self._no_slots
        else:
            slots = torch.from_numpy(values[0] if len(values) == 1 else np.concatenate(values))
            if not self._on_cpu:
                slots = slots.to(self.device)
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

    def walk_match(self, key: bytes, user: str | None = None) -> tuple[list[np.ndarray], TreeNode]:
        """The values along the longest page-aligned match of `key`, and its last node (split
        there when the match ends inside a node); refreshes last-access times on the path.
        `user` is not read: this tree is shared by everyone (the scoped cache reads it)."""
        now = time.monotonic()
        node = self.tree.root
        node.last_access_time = now
        values: list[np.ndarray] = []
        pos, end, page_bytes = 0, len(key), self.page_bytes
        while pos < end:
            child = node.children.get(key[pos : pos + page_bytes])
            if child is None:
                break
            last_access_time, child.last_access_time = child.last_access_time, now
            if key.startswith(child.key, pos):
                values.append(child.value)
                pos += len(child.key)
                node = child
                continue
            node = split_node(
                child, common_page_len(child.key, key, pos, self.page_size), self.page_bytes, self.recorder
            )
            if self._page_granular:
                child.last_access_time = last_access_time  # NOTE: the unmatched lower piece was not accessed
            values.append(node.value)
            break
        return values, node

    # -- insert ----------------------------------------------------------------------------

    def insert(
        self,
        token_ids: np.ndarray,
        slots: torch.Tensor,
        user: str | None = None,
        chunked: bool = False,
        priority: int = 0,
        rid: str | None = None,
    ) -> int:
        ids = as_token_ids(token_ids)
        if slots.shape[0] != len(ids):
            raise CacheMisuseError(f"insert: {len(ids)} token ids but {slots.shape[0]} slots")
        key_len = len(ids) - len(ids) % self.page_size
        key = page_key(ids, self.page_size)
        node, pos = self._walk_insert(key, chunked, priority)
        prefix_len = pos // TOKEN_BYTES
        if pos < len(key):
            host = slots.numpy() if self._on_cpu else slots.cpu().numpy()
            value = np.array(host[prefix_len:key_len], dtype=np.int64)
            self._add_leaf(node, key[pos:], value, user, 0 if chunked else 1, priority, rid)
        return prefix_len

    # -- requests (the shared bookkeeping in tree/requests.py) ------------------------------

    def cache_unfinished_req(self, req: CacheableRequest, chunked: bool = False) -> None:
        cache_unfinished_req(self, req, chunked)

    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None:
        cache_finished_req(self, req, is_insert)

    def insert_unfinished(
        self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor, chunked: bool
    ) -> int:
        """The caller frees its duplicates: they end at the prefix the tree already had."""
        return self.insert(token_ids, slots, user=req.user, chunked=chunked, rid=req.rid)

    def insert_finished(self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor) -> int:
        return self.insert(token_ids, slots, user=req.user, rid=req.rid)

    def _walk_insert(self, key: bytes, chunked: bool, priority: int) -> tuple[TreeNode, int]:
        now = time.monotonic()
        node = self.tree.root
        node.last_access_time = now
        pos, end, page_bytes = 0, len(key), self.page_bytes
        while pos < end:
            child = node.children.get(key[pos : pos + page_bytes])
            if child is None:
                break
            last_access_time, child.last_access_time = child.last_access_time, now
            if not key.startswith(child.key, pos):
                lower, child = (
                    child,
                    split_node(
                        child, common_page_len(child.key, key, pos, self.page_size), self.page_bytes, self.recorder
                    ),
                )
                if self._page_granular:
                    lower.last_access_time = last_access_time  # NOTE: the lower piece was not accessed
            if priority > child.priority:  # NOTE: after a split only the upper piece (SGLang 0.5.23's insert)
                child.priority = priority
            if not chunked:
                child.hit_count += 1
            pos += len(child.key)
            node = child
        return node, pos

    def _add_leaf(
        self,
        parent: TreeNode,
        key: bytes,
        value: np.ndarray,
        user: str | None,
        hits: int,
        priority: int,
        rid: str | None,
    ) -> TreeNode:
        tree = self.tree
        if tree.strict:
            tree.claim(value)
        leaf = TreeNode(key, value, time.monotonic())
        leaf.parent, leaf.owner, leaf.hit_count, leaf.priority = parent, user, hits, priority
        parent.children[key[: self.page_bytes]] = leaf
        tree.count_new(parent, leaf, value)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.INSERT,
                pool=PoolName.FULL,
                rid=rid,
                node_id=leaf.id,
                num_tokens=len(value),
                slots=value,
                aux=parent.id,
                principal=user,
            )
        return leaf

    # -- locks -----------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode, rid: str | None = None) -> int | None:
        moved = self.tree.lock(node)
        if self.recorder.enabled:
            self.recorder.record(EventKind.LOCK, rid=rid, node_id=node.id, num_tokens=moved)
        return None

    def dec_lock_ref(self, node: TreeNode, lock_id: int | None = None, rid: str | None = None) -> None:
        moved = self.tree.unlock(node)
        if self.recorder.enabled:
            self.recorder.record(EventKind.UNLOCK, rid=rid, node_id=node.id, num_tokens=moved)

    # -- eviction --------------------------------------------------------------------------

    def refresh_eviction_order(self) -> None:
        """Re-key every evictable leaf. Needed only after editing node fields by hand in a way
        that lowers a policy key; normal operation only ever raises keys."""
        self.tree.heap.rebuild(self.tree.evictable_leaves)

    def evict(self, params: EvictParams) -> EvictResult:
        return EvictResult(self.evict_tokens(params.num_tokens, params.swa_num_tokens))

    def evict_tokens(self, num_tokens: int, swa_num_tokens: int = 0) -> int:
        self.tree.check_evictable(num_tokens, swa_num_tokens)
        if num_tokens <= 0:
            return 0
        if self._page_granular or self.recorder.enabled:
            freed = self.tree.evict_leaves(num_tokens, self._evict_leaf)
        else:
            freed = self.tree.evict_whole_leaves(num_tokens)
        self.allocator.free_many(freed)
        return sum(len(chunk) for chunk in freed)

    def _evict_leaf(self, leaf: TreeNode, want: int) -> np.ndarray:
        """Page mode: only `want` tokens from the leaf's tail when it holds more; else the whole leaf."""
        tree = self.tree
        chunk = tree.trim_leaf(leaf, want) if self._page_granular and len(leaf.value) > want else tree.delete_leaf(leaf)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.EVICT,
                pool=PoolName.FULL,
                node_id=leaf.id,
                num_tokens=len(chunk),
                slots=chunk,
                reason=self.evict_reason,
            )
        return chunk

    # -- views -----------------------------------------------------------------------------

    def tree_slots(self) -> np.ndarray:
        return node_values([n for n, _, _ in walk(self.root) if n is not self.root])

    def check_integrity(self) -> None:
        """Every shared tree invariant (tree/integrity.py), and the evictable-leaf set is exact."""
        nodes = [(n, start) for n, _, start in walk(self.root) if n is not self.root]
        for node, start in nodes:
            check_node_shape(node, start, self.page_size)
        self.tree.check([n for n, _ in nodes])

    def pretty_print(self) -> str:
        return render(self.root)

    def export_nodes(self, preview_tokens: int = 8) -> list[NodeRow]:
        return export_rows(self.root, preview_tokens, page_size=self.page_size, memo=self._page_hash_memo)
