"""ScopedRadixCache: the radix cache with tenant isolation (docs/isolation.md).

A principal sees a node only when it is public, pinned, or in the principal's own namespace;
the match, the scheduler's order and the `cached_tokens` a server reports come from the visible
match alone. Visibility is decided before any side effect: no split, counter, LRU touch or lock
happens on a node the principal cannot see.

NOTE: lifecycle of a node
    born     private to the principal that computed it (owner = holders = {p}), or pinned
             when its pages lie on an operator-declared prefix under a public/pinned parent
    promote  at an epoch boundary, the private child of a public/pinned node (or of the root)
             whose tokens at least `promote_k` distinct principals computed within the window
             (the creator ledger) turns public, cut at the longest such page prefix; a public
             copy with the same first page already there blocks it (the copy stays private)
    demote   the anomaly monitor tombstones a public subtree: invisible at once; the pages of
             unlocked nodes are freed now, those of locked ones when their last lock drops
    evict    as RadixCache: whole leaves, or page-granular tail trims of the coldest leaf
Named options: promote_k (None: never, per-principal isolation), epoch_s, pinned, dedup (a
principal whose tokens equal another's private copy joins its holders and frees its own pages;
off: it keeps its own copy), merge_chains (unary private chains merge into one node at epoch
boundaries), monitor. LRU stamps come from a counter, not a clock, so equal runs evict equally.
Locks, the evictable accounting and the eviction loop are the shared LockedTree's (tree/core.py),
as RadixCache holds them; this class decides what a principal sees, files children as copies per
first page, and what a tombstone frees.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

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
    request_row,
)
from kvscope.cache.scoped.creators import ROOT_HASH, CreatorLedger, chain_hashes
from kvscope.cache.scoped.monitor import MonitorConfig
from kvscope.cache.scoped.node import (
    PINNED,
    PRIVATE,
    PUBLIC,
    ScopedNode,
    detach_copy,
    is_scoped_leaf,
    path_values,
    principal_key,
    walk_scoped,
)
from kvscope.cache.tree import (
    TOKEN_BYTES,
    LockedTree,
    check_tree_options,
    common_page_len,
    get_policy,
    page_hashes,
    slots_tensor,
    up_path,
)
from kvscope.cache.tree.node import PageHashMemo, preview
from kvscope.mem import BaseTokenAllocator, IntegrityError, ReqToTokenPool
from kvscope.telemetry import NULL_RECORDER, EventKind, EvictReason, PoolName, Recorder, Visibility

HITS_CAP = 64  # principals a node's hit window keeps per epoch


def joined(principals: Iterable[str]) -> str | None:
    """The principals of a promote or demote event, sorted and comma-joined, cut to the column's 64
    characters (the event's aux holds how many there are)."""
    text = ",".join(sorted(principals))
    return text[:64] if text else None


@dataclass
class ScopedStats:
    """Counters since the cache was built (reset() keeps them: they describe the whole run)."""

    promotions: int = 0
    promoted_tokens: int = 0
    demotions: int = 0
    tombstoned_tokens: int = 0
    matched_tokens: int = 0
    cross_hit_tokens: int = 0  # matched tokens that sat in nodes another principal created
    dedup_joins: int = 0
    merges: int = 0
    tokens_by_owner: dict[tuple[str | None, str], int] = field(default_factory=dict)  # filled by stats()


class ScopedRadixCache(BasePrefixCache):
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
        promote_k: int | None = 3,
        epoch_s: float = 60.0,
        pinned: Sequence[Sequence[int] | np.ndarray] = (),
        dedup: bool = False,
        merge_chains: bool = False,
        monitor: MonitorConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_tree_options(allocator, page_size, eviction_granularity)
        if promote_k is not None and promote_k < 1:
            raise CacheMisuseError(f"promote_k must be >= 1 or None (never), got {promote_k}")
        if not epoch_s > 0 or epoch_s == float("inf"):
            raise CacheMisuseError(f"epoch_s must be a positive number of seconds, got {epoch_s}")
        self.promote_k = promote_k
        self.epoch_s = epoch_s
        self.dedup = dedup
        self.merge_chains = merge_chains
        self.monitor = monitor
        self.clock = clock
        self.stats_counters = ScopedStats()
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
        self._page_granular = eviction_granularity == "page"
        self.recorder = recorder
        self.strict = strict
        self.reset()
        self.pinned_hashes: set[bytes] = set()
        for prefix in pinned:
            self.pinned_hashes.update(
                chain_hashes(ROOT_HASH, page_key(as_token_ids(prefix), page_size), self.page_bytes)
            )

    def reset(self) -> None:
        """Forget the tree and the creator ledger (the caller clears the allocator too)."""
        self.tree = LockedTree(
            ScopedNode(now=time.monotonic()),
            self.allocator,
            self.policy,
            deeper_first=self._page_granular,
            strict=self.strict,
            detach=self._detach,
            is_leaf=is_scoped_leaf,
        )
        self._ticks = itertools.count(1)
        self._num_tombstoned = 0  # nodes tombstoned and still in the tree (locked): unlocks look for them
        self.ledger = CreatorLedger()
        self._start_s = self.clock()
        self._epoch = 0

    @property
    def root(self) -> ScopedNode:
        return self.tree.root

    def evictable_size(self) -> int:
        return self.tree.evictable_len

    def protected_size(self) -> int:
        return self.tree.protected_len

    def total_size(self) -> int:
        return self.tree.evictable_len + self.tree.protected_len

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Epochs from now on read `clock` (trace time in replays); the current epoch restarts at 0."""
        self.clock = clock
        self._start_s = clock()
        self._epoch = 0

    def epoch(self) -> int:
        return int((self.clock() - self._start_s) // self.epoch_s)

    # -- epochs: promotion, ledger pruning, chain merging ---------------------------------------

    def advance(self) -> None:
        """Run the epoch-boundary work once per new epoch (every public entry point calls it)."""
        epoch = self.epoch()
        if epoch <= self._epoch:  # NOTE: a clock that steps back (an unsorted trace) never rolls windows back
            return
        if self.promote_k is not None:
            # NOTE: the boundary into epoch j promotes on the window that just closed (read at j - 1);
            # after a jump of several epochs only the first two boundaries can find any creators
            for closed in range(self._epoch, min(epoch, self._epoch + 2)):
                self._promote_all(closed)
        self._epoch = epoch
        self.ledger.prune(epoch)
        if self.merge_chains:
            self.merge_private_chains()

    def _promote_all(self, epoch: int) -> None:
        stack = [self.root]
        while stack:
            parent = stack.pop()
            for child in [c for c in parent.copies() if not c.tombstone]:
                if child.visibility != PRIVATE:
                    stack.append(child)
                    continue
                promoted = self._try_promote(parent, child, epoch)
                if promoted is not None:
                    stack.append(promoted)

    def _try_promote(self, parent: ScopedNode, node: ScopedNode, epoch: int) -> ScopedNode | None:
        assert self.promote_k is not None
        first = node.key[: self.page_bytes]
        if any(c.visibility != PRIVATE and not c.tombstone for c in parent.children[first]):
            return None  # a public copy already starts here; this one stays its holders'
        hashes = chain_hashes(parent.path_hash, node.key, self.page_bytes)
        pages = 0
        creators: set[str] = set()
        for h in hashes:
            found = self.ledger.creators(h, epoch)
            if len(found) < self.promote_k:
                break
            pages, creators = pages + 1, found
        if pages == 0:
            return None
        upper = node if pages * self.page_size == len(node.value) else self._split(node, pages * self.page_size)
        upper.visibility = PUBLIC
        upper.holders = frozenset()
        self.stats_counters.promotions += 1
        self.stats_counters.promoted_tokens += len(upper.value)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.PROMOTE,
                pool=PoolName.FULL,
                node_id=upper.id,
                num_tokens=len(upper.value),
                aux=len(creators),
                principal=joined(creators),
            )
        return upper

    def merge_private_chains(self) -> int:
        """Merge each unary chain of unlocked private nodes with one owner and holder set into one
        node (matching then compares one key instead of one node per turn); the number merged."""
        merged = 0
        for node, _, _ in walk_scoped(self.root):
            if node is self.root or node.parent is None:
                continue
            while self._mergeable(node):
                (child,) = node.copies()
                node.key += child.key
                node.value = np.concatenate((node.value, child.value))
                node.children = child.children
                for grandchild in node.copies():
                    grandchild.parent = node
                node.path_hash = child.path_hash
                node.last_access_time = max(node.last_access_time, child.last_access_time)
                node.hit_count = max(node.hit_count, child.hit_count)
                child.parent, child.children = None, {}
                self.tree.evictable_leaves.discard(child)
                self.tree.mark_leaf(node)
                merged += 1
        self.stats_counters.merges += merged
        return merged

    @staticmethod
    def _mergeable(node: ScopedNode) -> bool:
        if node.visibility != PRIVATE or node.lock_ref or node.tombstone or node.num_children() != 1:
            return False
        (child,) = node.copies()
        return (
            child.visibility == PRIVATE
            and not child.lock_ref
            and not child.tombstone
            and child.owner == node.owner
            and child.holders == node.holders
        )

    # -- match -----------------------------------------------------------------------------

    def match_prefix(self, token_ids: np.ndarray, user: str | None = None, rid: str | None = None) -> MatchResult:
        self.advance()
        ids = token_ids if type(token_ids) is np.ndarray and token_ids.dtype == TOKEN_DTYPE else as_token_ids(token_ids)
        key_len = len(ids) - len(ids) % self.page_size
        principal = principal_key(user)
        path = self._visible_path(ids[:key_len].tobytes(), principal, split=True)
        counted = rid is not None  # NOTE: a match with no request is a look (lpm's ordering pass): no hits counted
        if self.monitor is not None and counted:
            path = self._watch(path, principal)
        node = path[-1] if path else self.root
        values = [n.value for n in path]
        slots = self._no_slots if not values else torch.from_numpy(np.concatenate(values))
        if not self._on_cpu and values:
            slots = slots.to(self.device)
        if not counted:
            return MatchResult(slots, node)
        cross = sum(len(n.value) for n in path if n.owner != principal)
        self.stats_counters.matched_tokens += len(slots)
        self.stats_counters.cross_hit_tokens += cross
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
            if cross:
                self.recorder.record(
                    EventKind.CROSS_HIT, pool=PoolName.FULL, rid=rid, node_id=node.id, num_tokens=cross, principal=user
                )
        return MatchResult(slots, node)

    def walk_match(self, key: bytes, user: str | None = None) -> tuple[list[np.ndarray], ScopedNode]:
        """The values along the longest visible page-aligned match of `key` for `user`, and its
        last node (split there when the match ends inside a node)."""
        path = self._visible_path(key, principal_key(user), split=True)
        return [n.value for n in path], (path[-1] if path else self.root)

    def _visible_path(
        self, key: bytes, principal: str, split: bool, start: ScopedNode | None = None
    ) -> list[ScopedNode]:
        """The nodes of the visible match of `key` below `start` (the root), choosing at each level
        the copy that shares the most tokens, splitting the last one where the match ends inside
        it (when `split`); touches only what `principal` may see."""
        tick = next(self._ticks)
        node = self.root if start is None else start
        node.last_access_time = tick
        path: list[ScopedNode] = []
        pos, end = 0, len(key)
        while pos < end:
            child, shared = self._best_copy(node, key, pos, principal)
            if child is None:
                break
            previous, child.last_access_time = child.last_access_time, tick
            if shared < len(child.value):
                if not split:
                    child.last_access_time = previous
                    break
                lower, child = child, self._split(child, shared)
                if self._page_granular:
                    lower.last_access_time = previous  # NOTE: as RadixCache: the unmatched lower piece was not accessed
                path.append(child)
                break
            path.append(child)
            pos += len(child.key)
            node = child
        return path

    def _best_copy(
        self, node: ScopedNode, key: bytes, pos: int, principal: str, visible: bool = True
    ) -> tuple[ScopedNode | None, int]:
        """Among the copies under `node` starting with key[pos]'s page that `principal` sees (or,
        visible=False, does not see), the one sharing the most tokens with key[pos:]; a public or
        pinned copy wins ties."""
        copies = node.children.get(key[pos : pos + self.page_bytes])
        best, best_len = None, 0
        if not copies:
            return None, 0
        for copy in copies:
            if copy.tombstone or copy.sees(principal) != visible:
                continue
            shared = common_page_len(copy.key, key, pos, self.page_size)
            if shared > best_len or (
                shared == best_len and best is not None and best.visibility == PRIVATE and copy.visibility != PRIVATE
            ):
                best, best_len = copy, shared
        return (best, best_len) if best_len else (None, 0)

    def _watch(self, path: list[ScopedNode], principal: str) -> list[ScopedNode]:
        """Count the hits of public nodes on the path; demote a node whose pattern trips the
        monitor, and cut the match before it."""
        assert self.monitor is not None
        epoch = self.epoch()
        for i, node in enumerate(path):
            if node.visibility != PUBLIC:
                continue
            node.hits.add(epoch, principal, HITS_CAP)
            hits, previous = node.hits.counts(epoch)
            users = node.hits.principals(epoch)
            if self.monitor.tripped(hits, previous, len(node.hits.buckets(epoch)[0])):
                self.demote(node, sorted(users))
                return path[:i]
        return path

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
        """Insert for a caller that holds no path (a replay, a test): from the root, along the
        principal's visible match."""
        self.advance()
        ids = as_token_ids(token_ids)
        if slots.shape[0] != len(ids):
            raise CacheMisuseError(f"insert: {len(ids)} token ids but {slots.shape[0]} slots")
        key = page_key(ids, self.page_size)
        return self._insert_from(self.root, 0, key, slots, principal_key(user), chunked, priority, rid)[1]

    def _insert_from(
        self,
        start: ScopedNode,
        start_tokens: int,
        key: bytes,
        slots: torch.Tensor,
        principal: str,
        chunked: bool,
        priority: int,
        rid: str | None,
    ) -> tuple[ScopedNode, int]:
        """Insert key[start_tokens:] below `start` (a node the principal holds, ending at
        start_tokens): on along the visible copies, then (dedup) the copies it has just
        recomputed, then new leaves. Returns the node where the key ends and the tokens the tree
        already had (the caller's duplicates end there)."""
        pos = start_tokens * TOKEN_BYTES
        path = self._visible_path(key[pos:], principal, split=True, start=start)
        node = path[-1] if path else start
        for n in path:
            if priority > n.priority:
                n.priority = priority
            if not chunked:
                n.hit_count += 1
        pos += sum(len(n.key) for n in path)
        if pos < len(key):  # the principal computed these pages itself: the ledger counts it
            self.ledger.record(chain_hashes(node.path_hash, key[pos:], self.page_bytes), principal, self._epoch)
        if self.dedup:
            node, pos = self._join_copies(node, key, pos, principal)
        prefix_len = pos // TOKEN_BYTES
        if pos < len(key):
            host = slots.numpy() if self._on_cpu else slots.cpu().numpy()
            value = np.array(host[prefix_len : len(key) // TOKEN_BYTES], dtype=np.int64)
            node = self._add_leaves(node, key[pos:], value, principal, 0 if chunked else 1, priority, rid)
        return node, prefix_len

    def _join_copies(self, node: ScopedNode, key: bytes, pos: int, principal: str) -> tuple[ScopedNode, int]:
        """dedup on: walk on through private copies the principal cannot see but has just
        computed the same tokens of, joining their holders (its own pages are then duplicates)."""
        while pos < len(key):
            copy, shared = self._best_copy(node, key, pos, principal, visible=False)
            if copy is None or copy.visibility != PRIVATE:
                break
            if shared < len(copy.value):
                copy = self._split(copy, shared)
            copy.holders = copy.holders | {principal}
            self.stats_counters.dedup_joins += 1
            pos += len(copy.key)
            node = copy
        return node, pos

    def _add_leaves(
        self,
        parent: ScopedNode,
        key: bytes,
        value: np.ndarray,
        principal: str,
        hits: int,
        priority: int,
        rid: str | None,
    ) -> ScopedNode:
        """New pages: pinned while they lie on a declared prefix under a public/pinned parent,
        private to `principal` after that."""
        pinned_pages = 0
        if self.pinned_hashes and (parent is self.root or parent.visibility != PRIVATE):
            for h in chain_hashes(parent.path_hash, key, self.page_bytes):
                if h not in self.pinned_hashes:
                    break
                pinned_pages += 1
        cut = pinned_pages * self.page_size
        if cut:
            parent = self._add_scoped_leaf(
                parent, key[: cut * TOKEN_BYTES], value[:cut], principal, PINNED, hits, priority, rid
            )
        if cut < len(value):
            parent = self._add_scoped_leaf(
                parent, key[cut * TOKEN_BYTES :], value[cut:], principal, PRIVATE, hits, priority, rid
            )
        return parent

    def _add_scoped_leaf(
        self,
        parent: ScopedNode,
        key: bytes,
        value: np.ndarray,
        principal: str,
        visibility: Visibility,
        hits: int,
        priority: int,
        rid: str | None,
    ) -> ScopedNode:
        self.tree.claim(value)
        leaf = ScopedNode(key, value, next(self._ticks))
        leaf.parent, leaf.owner, leaf.hit_count, leaf.priority = parent, principal, hits, priority
        leaf.visibility = visibility
        leaf.holders = frozenset({principal}) if visibility == PRIVATE else frozenset()
        leaf.path_hash = chain_hashes(parent.path_hash, key, self.page_bytes)[-1]
        parent.children.setdefault(key[: self.page_bytes], []).append(leaf)
        self.tree.count_new(parent, leaf, value)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.INSERT,
                pool=PoolName.FULL,
                rid=rid,
                node_id=leaf.id,
                num_tokens=len(value),
                slots=value,
                aux=parent.id,
                principal=principal,
                reason=visibility,
            )
        return leaf

    def _split(self, child: ScopedNode, split_len: int) -> ScopedNode:
        """Cut `child` after split_len tokens; the upper half takes its place among the parent's
        copies and gets copies (never shared objects) of its counters and holders."""
        parent = child.parent
        assert parent is not None
        cut = split_len * TOKEN_BYTES
        upper = ScopedNode(child.key[:cut], child.value[:split_len], child.last_access_time)
        upper.parent, upper.lock_ref = parent, child.lock_ref
        upper.hit_count, upper.priority, upper.owner = child.hit_count, child.priority, child.owner
        upper.creation_time, upper.tombstone, upper.visibility = child.creation_time, child.tombstone, child.visibility
        upper.holders, upper.hits = child.holders, child.hits.copy()
        upper.path_hash = chain_hashes(parent.path_hash, upper.key, self.page_bytes)[-1]
        copies = parent.children[child.key[: self.page_bytes]]
        copies[copies.index(child)] = upper
        child.key, child.value, child.parent = child.key[cut:], child.value[split_len:], upper
        upper.children = {child.key[: self.page_bytes]: [child]}
        if self.recorder.enabled:
            self.recorder.record(EventKind.SPLIT, node_id=upper.id, num_tokens=split_len, aux=child.id)
        return upper

    # -- requests ------------------------------------------------------------------------------

    # NOTE: SGLang's bookkeeping (tree/requests.py), with one difference: a request's insert goes on
    # from the node it holds (its last_node, which ends at cache_protected_len), never from the root.
    # Copies of the same tokens sit side by side here, and a walk from the root may take another
    # copy than the one the request's row points at; re-pointing only part of the row would leave
    # the rest on nodes no longer locked. A request whose held path was tombstoned keeps its own
    # pages until it ends, and nothing of it is inserted (its tokens are no longer visible to anyone).

    def cache_unfinished_req(self, req: CacheableRequest, chunked: bool = False) -> None:
        last = cast(ScopedNode, req.last_node)
        if last.tombstone:
            return
        self.advance()
        ids = req.fill_ids
        kv = request_row(self.req_to_token_pool, req, len(ids))
        key_len = len(ids) // self.page_size * self.page_size
        protected = req.cache_protected_len
        new_last, duplicates_end = self._insert_from(
            last, protected, page_key(ids, self.page_size), kv, principal_key(req.user), chunked, 0, req.rid
        )
        self.allocator.free(kv[protected:duplicates_end])
        new_slots = slots_tensor(path_values(new_last), self.device)
        if len(new_slots) != key_len:
            raise CacheMisuseError(f"after insert the request's path holds {len(new_slots)} of {key_len} tokens")
        assert self.req_to_token_pool is not None and req.req_pool_idx is not None
        self.req_to_token_pool.write(req.req_pool_idx, protected, new_slots[protected:])
        self.dec_lock_ref(last, rid=req.rid)
        self.inc_lock_ref(new_last, rid=req.rid)
        req.last_node = new_last
        req.cache_protected_len = key_len
        req.prefix_indices = torch.cat((new_slots, kv[key_len:]))

    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None:
        last = cast(ScopedNode, req.last_node)
        kv_len = req.kv_committed_len
        kv = request_row(self.req_to_token_pool, req, kv_len)
        key_len = kv_len // self.page_size * self.page_size
        protected = req.cache_protected_len
        duplicates_end = key_len
        if is_insert and not last.tombstone:
            self.advance()
            ids = req.fill_ids[:kv_len]
            duplicates_end = self._insert_from(
                last, protected, page_key(ids, self.page_size), kv, principal_key(req.user), False, 0, req.rid
            )[1]
        self.allocator.free_segments([(kv[protected:duplicates_end], protected), (kv[key_len:], key_len)])
        self.dec_lock_ref(last, rid=req.rid)
        req.swa_lock_id = None

    # -- locks (a tombstoned node is never an evictable leaf, and is freed at its last unlock) --

    def inc_lock_ref(self, node: ScopedNode, rid: str | None = None) -> int | None:
        moved = self.tree.lock(node)
        if self.recorder.enabled:
            self.recorder.record(EventKind.LOCK, rid=rid, node_id=node.id, num_tokens=moved)
        return None

    def dec_lock_ref(self, node: ScopedNode, lock_id: int | None = None, rid: str | None = None) -> None:
        moved = self.tree.unlock(node)
        if self.recorder.enabled:
            self.recorder.record(EventKind.UNLOCK, rid=rid, node_id=node.id, num_tokens=moved)
        if not self._num_tombstoned:
            return
        top = None  # the highest tombstoned node on the path this unlock left unlocked
        for above in up_path(node):
            if above.tombstone and above.lock_ref == 0:
                top = above
        if top is not None:
            self._free_subtree(top)

    # -- demotion --------------------------------------------------------------------------

    def demote(self, node: ScopedNode, principals: Sequence[str] = ()) -> int:
        """Tombstone `node`'s subtree: invisible to everyone now; pages of unlocked nodes freed now,
        of locked ones when their last lock drops. Returns the tokens tombstoned."""
        subtree = [n for n, _, _ in walk_scoped(node) if not n.tombstone]
        tokens = sum(len(n.value) for n in subtree)
        for n in subtree:
            n.tombstone = True
            self._num_tombstoned += 1
            n.visibility = PRIVATE
            n.holders = frozenset()
            self.tree.evictable_leaves.discard(n)
            if self.recorder.enabled:
                self.recorder.record(EventKind.TOMBSTONE, pool=PoolName.FULL, node_id=n.id, num_tokens=len(n.value))
        self.stats_counters.demotions += 1
        self.stats_counters.tombstoned_tokens += tokens
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.DEMOTE,
                pool=PoolName.FULL,
                node_id=node.id,
                num_tokens=tokens,
                aux=len(principals),
                principal=joined(principals),
            )
        if node.lock_ref == 0:
            self._free_subtree(node)
        else:
            for n, _, _ in walk_scoped(node):
                if n.lock_ref == 0 and n.parent is not None and n.parent.lock_ref > 0:
                    self._free_subtree(n)
        return tokens

    def _free_subtree(self, top: ScopedNode) -> None:
        """Remove an unlocked tombstoned subtree and free its pages (EVICT, reason tombstone)."""
        nodes = [n for n, _, _ in walk_scoped(top)]
        assert all(n.lock_ref == 0 and n.tombstone for n in nodes), "freeing a locked or live node"
        parent = top.parent
        assert parent is not None
        copies = parent.children[top.key[: self.page_bytes]]
        copies.remove(top)
        if not copies:
            del parent.children[top.key[: self.page_bytes]]
        freed = []
        self._num_tombstoned -= len(nodes)
        for n in nodes:
            self.tree.evictable_len -= len(n.value)
            self.tree.evictable_leaves.discard(n)
            self.tree.release(n.value)
            n.parent = None
            freed.append(n.value)
            if self.recorder.enabled:
                self.recorder.record(
                    EventKind.EVICT,
                    pool=PoolName.FULL,
                    node_id=n.id,
                    num_tokens=len(n.value),
                    slots=n.value,
                    reason=EvictReason.TOMBSTONE,
                )
        self.allocator.free_many(freed)
        self.tree.mark_leaf(parent)

    # -- eviction --------------------------------------------------------------------------

    def refresh_eviction_order(self) -> None:
        """Re-key every evictable leaf (after editing node fields by hand; see RadixCache)."""
        self.tree.heap.rebuild(self.tree.evictable_leaves)

    def evict(self, params: EvictParams) -> EvictResult:
        return EvictResult(self.evict_tokens(params.num_tokens, params.swa_num_tokens))

    def evict_tokens(self, num_tokens: int, swa_num_tokens: int = 0) -> int:
        self.advance()
        self.tree.check_evictable(num_tokens, swa_num_tokens)
        if num_tokens <= 0:
            return 0
        freed = self.tree.evict_leaves(num_tokens, self._evict_leaf)
        self.allocator.free_many(freed)
        return sum(len(chunk) for chunk in freed)

    def _evict_leaf(self, leaf: ScopedNode, want: int) -> np.ndarray:
        """As RadixCache: page mode trims only `want` tokens off a longer leaf (its path hash follows)."""
        if self._page_granular and len(leaf.value) > want:
            chunk = self.tree.trim_leaf(leaf, want)
            assert leaf.parent is not None
            leaf.path_hash = chain_hashes(leaf.parent.path_hash, leaf.key, self.page_bytes)[-1]
        else:
            chunk = self.tree.delete_leaf(leaf)
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

    def _detach(self, leaf: ScopedNode) -> None:
        detach_copy(leaf, self.page_bytes)

    # -- views -----------------------------------------------------------------------------

    def stats(self) -> ScopedStats:
        """The counters, with the tokens in the tree by (owner, visibility) as of now."""
        by_owner: dict[tuple[str | None, str], int] = {}
        for node, _, _ in walk_scoped(self.root):
            if node is not self.root and not node.tombstone:
                k = (node.owner, node.visibility)
                by_owner[k] = by_owner.get(k, 0) + len(node.value)
        self.stats_counters.tokens_by_owner = by_owner
        return self.stats_counters

    def tree_slots(self) -> np.ndarray:
        values = [n.value for n, _, _ in walk_scoped(self.root) if n is not self.root]
        return np.concatenate(values) if values else np.empty(0, dtype=np.int64)

    def check_integrity(self) -> None:
        """Tree shape, visibility, accounting and slot invariants (IntegrityError with the numbers)."""
        nodes = [(n, start) for n, _, start in walk_scoped(self.root) if n is not self.root]
        ps, pb = self.page_size, self.page_bytes
        for node, start in nodes:
            parent = node.parent
            if parent is None or node not in parent.children.get(node.key[:pb], []):
                raise IntegrityError(f"node {node.id} is not among its parent's copies under its first page")
            if len(node.key) != TOKEN_BYTES * len(node.value) or not len(node.value) or len(node.value) % ps:
                raise IntegrityError(
                    f"node {node.id}: {len(node.key) // TOKEN_BYTES} key tokens, "
                    f"{len(node.value)} slots, page_size {ps}"
                )
            if node.lock_ref < 0 or node.lock_ref < sum(c.lock_ref for c in node.copies()):
                raise IntegrityError(f"node {node.id}: lock_ref {node.lock_ref} below 0 or its children's sum")
            if ps > 1 and (node.value % ps != np.arange(start, start + len(node.value)) % ps).any():
                raise IntegrityError(f"node {node.id}: slots not page-aligned with their positions")
            self._check_scope(node, parent)
            if node.path_hash != chain_hashes(parent.path_hash, node.key, pb)[-1]:
                raise IntegrityError(f"node {node.id}: stale path hash")
        for parent in [self.root, *(n for n, _ in nodes)]:
            for first, copies in parent.children.items():
                public = [c for c in copies if c.visibility != PRIVATE and not c.tombstone]
                if len(public) > 1:
                    raise IntegrityError(f"node {parent.id}: {len(public)} public copies under one first page")
                if not copies or any(c.key[:pb] != first for c in copies):
                    raise IntegrityError(f"node {parent.id}: a copy list is empty or misfiled")
        self.tree.check([n for n, _ in nodes])

    def _check_scope(self, node: ScopedNode, parent: ScopedNode) -> None:
        if node.tombstone and node.lock_ref == 0:
            raise IntegrityError(f"node {node.id}: an unlocked tombstone still in the tree")
        if parent.tombstone and not node.tombstone:
            raise IntegrityError(f"node {node.id}: live under a tombstoned parent {parent.id}")
        if node.tombstone:
            return
        if node.visibility == PRIVATE:
            if not node.holders or node.owner is None or (node.owner not in node.holders and not self.dedup):
                raise IntegrityError(
                    f"node {node.id}: private with holders {sorted(node.holders)}, owner {node.owner!r}"
                )
            if parent.visibility == PRIVATE and parent is not self.root and not node.holders <= parent.holders:
                raise IntegrityError(
                    f"node {node.id}: sees wider than its parent {parent.id} "
                    f"({sorted(node.holders)} vs {sorted(parent.holders)})"
                )
        elif parent is not self.root and parent.visibility == PRIVATE:
            raise IntegrityError(f"node {node.id}: {node.visibility} under the private node {parent.id}")
        if node.visibility == PUBLIC and self.promote_k is None:
            raise IntegrityError(f"node {node.id}: public, but promotion is off (promote_k = inf)")

    def pretty_print(self) -> str:
        lines = []
        for node, depth, _ in walk_scoped(self.root):
            if node is self.root:
                lines.append(f"root [{node.id}]")
                continue
            flags = " tombstone" if node.tombstone else ""
            lines.append(
                f"{'  ' * depth}[{node.id}] {len(node.value)} tok {node.visibility} owner={node.owner} "
                f"lock={node.lock_ref} hits={node.hit_count}{flags}: {preview(node, 6)}"
            )
        return "\n".join(lines)

    def export_nodes(self, preview_tokens: int = 8) -> list[NodeRow]:
        walked = walk_scoped(self.root)
        hashes = page_hashes(walked, self.page_size, self._page_hash_memo)
        return [
            NodeRow(
                node_id=node.id,
                parent_id=None if node.parent is None else node.parent.id,
                num_tokens=len(node.value),
                token_preview=preview(node, preview_tokens),
                lock_ref=node.lock_ref,
                last_access_time=float(node.last_access_time),
                hit_count=node.hit_count,
                owner=node.owner,
                tombstone=node.tombstone,
                depth_tokens=start + len(node.value),
                visibility=node.visibility if node is not self.root else PUBLIC,
                page_hashes=hashes[node.id],
            )
            for node, _, start in walked
        ]
