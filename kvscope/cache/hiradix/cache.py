"""HiRadixCache: SGLang's two-tier radix cache (docs/memory-semantics.md §7), a device tier
over a host tier, beside the radix cache of §4: it holds the same LockedTree (tree/core.py)
over its device nodes.

NOTE: node tiers (node.py): device-only, device+host (backed up), host-only (evicted).
Invariants, exact after every call (check_integrity):
    device nodes are closed under ancestors (a device node's parent is the root or a device node)
    every host-only node is backed up and unlocked; through policies: backups are closed under ancestors
    evictable_size / protected_size = Σ len(value) over unlocked / locked DEVICE nodes
    evictable leaves = unlocked device nodes with no device child
    host_allocator.available_size() + Σ len(host_value) == host_allocator.total_size
    a node with write_op / load_op belongs to that in-flight op; its op's deepest node is locked
Write policies (threshold = hit_count that triggers a backup):
    write_through            1: a new leaf is backed up at its insert
    write_through_selective  2: on its second insert
    write_back               never on hits; an evicted device leaf is written then (synchronously)
Ops: `write` / `load` on the controller take an opaque op id; `writing_check()` /
`loading_check()` turn the acknowledgements into lock releases (and host unpins).
Events (telemetry/events.py): write and load when an op starts, ack when it is acknowledged,
their locks with aux = the op id; a device eviction is an evict with reason to-host (the node
keeps its host copy) or drop; a host copy leaving the tree is a host_evict, then the host
allocator's free.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvscope.cache.base import (
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
from kvscope.cache.hiradix.node import HiTreeNode, hi_walk, is_device_leaf, split_hi_node
from kvscope.cache.tree import (
    TOKEN_BYTES,
    LockedTree,
    cache_finished_req,
    cache_unfinished_req,
    check_node_shape,
    check_sizes,
    check_tree_options,
    common_page_len,
    detach_child,
    get_policy,
    page_hashes,
    preview,
    render,
)
from kvscope.cache.tree.node import PageHashMemo
from kvscope.mem import BaseTokenAllocator, CacheController, HostTokenAllocator, IntegrityError, ReqToTokenPool
from kvscope.telemetry import NULL_RECORDER, CopyKind, EventKind, EvictReason, PoolName, Recorder

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
WRITE_THROUGH_THRESHOLD: dict[str, int] = {"write_through": 1, "write_through_selective": 2}
LOAD_BACK_MIN_TOKENS = 10  # NOTE: SGLang's load_back_threshold: shorter host hits are recomputed
EMPTY_HOST = np.empty(0, dtype=np.int64)
# (node, its host slots) before a host copy that leaves the tree is freed -> True when the hook
# took the free over (fault injection: host-leak)
HostFreeHook = Callable[["HiTreeNode", np.ndarray], bool]


class HiMatchResult(MatchResult):
    """A MatchResult (device_indices, last_node = the last DEVICE node, prefix_len) plus the
    host tier: `host_hit_length`, tokens in host-only nodes behind last_node on the matched
    path, and `last_host_node`, the deepest backed-up node of the match (init_load_back's start)."""

    host_hit_length: int
    last_host_node: Any

    def __new__(
        cls, device_indices: torch.Tensor, last_node: Any, host_hit_length: int = 0, last_host_node: Any = None
    ) -> HiMatchResult:
        self = super().__new__(cls, device_indices, last_node)
        self.host_hit_length = host_hit_length
        self.last_host_node = last_node if last_host_node is None else last_host_node
        return self


@dataclass(slots=True)
class InFlight:
    """One controller op: `lock_node` stays locked until its ack (None: nothing locked);
    `nodes` carry its id (both halves of a split among them)."""

    kind: Literal["write", "load"]
    lock_node: HiTreeNode | None
    nodes: list[HiTreeNode] = field(default_factory=list)
    num_tokens: int = 0


class HiRadixCache(BasePrefixCache):
    def __init__(
        self,
        allocator: BaseTokenAllocator,
        page_size: int,
        controller: CacheController,
        *,
        write_policy: WritePolicy = "write_through",
        req_to_token_pool: ReqToTokenPool | None = None,
        eviction_policy: str = "lru",
        recorder: Recorder = NULL_RECORDER,
        strict: bool = False,
    ) -> None:
        check_tree_options(allocator, page_size, "leaf")
        if write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise CacheMisuseError(f"unknown write policy {write_policy!r}")
        if controller.device_allocator is not allocator:
            raise CacheMisuseError("the controller must load into this cache's device allocator")
        if controller.host_allocator.page_size != page_size:
            raise CacheMisuseError(f"host page_size {controller.host_allocator.page_size} != {page_size}")
        self.controller = controller
        self.host_allocator: HostTokenAllocator = controller.host_allocator
        self.write_policy = write_policy
        self.write_through_threshold = WRITE_THROUGH_THRESHOLD.get(write_policy, 0)
        self._op_ids = itertools.count(1)
        self.on_host_free: HostFreeHook | None = None
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self._page_hash_memo: PageHashMemo = {}  # NOTE: snapshots hash only new or split nodes
        self.page_bytes = page_size * TOKEN_BYTES
        self.device = allocator.device
        self._on_cpu = self.device.type == "cpu"
        self._no_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        self.policy = get_policy(eviction_policy)
        self.eviction_granularity = "leaf"  # NOTE: a leaf moves to the host whole
        self.recorder = recorder
        self.strict = strict
        self._staged: list[np.ndarray] = []  # NOTE: one eviction's leaves written to the host (freed at its flush)
        self._dropped: dict[int, np.ndarray] = {}  # NOTE: one write_back eviction's dropped leaves, by chunk id
        self._pinned: list[HiTreeNode] = []  # NOTE: staged leaves whose host copies no host eviction may take yet
        self.reset()

    def reset(self) -> None:
        """Forget both tiers (the caller clears both allocators, and has drained the controller)."""
        root = HiTreeNode(now=time.monotonic(), value=np.empty(0, dtype=np.int64), host_value=EMPTY_HOST)
        self.tree = LockedTree(
            root,
            self.allocator,
            self.policy,
            deeper_first=False,
            strict=self.strict,
            detach=self._detach,
            is_leaf=is_device_leaf,
        )
        self._in_flight: dict[int, InFlight] = {}
        self.num_dropped_tokens = 0  # NOTE: write_back: device tokens the host could not take (host_pressure)
        self.num_load_back_tokens = 0
        self.num_load_evicted_tokens = 0  # NOTE: device tokens load_back evicted to make room (no evict_for saw them)
        self.num_write_tokens = 0
        self._host_size = 0  # NOTE: host slots the tree holds (Σ len(host_value)), kept as nodes change

    @property
    def root(self) -> HiTreeNode:
        return self.tree.root

    def evictable_size(self) -> int:
        """Device tokens in unlocked device nodes."""
        return self.tree.evictable_len

    def protected_size(self) -> int:
        return self.tree.protected_len

    def total_size(self) -> int:
        return self.tree.evictable_len + self.tree.protected_len

    @property
    def through(self) -> bool:
        return self.write_policy != "write_back"

    def host_tokens(self) -> int:
        """Host slots the tree holds (every backed-up node's host_value)."""
        return self._host_size

    # -- match -----------------------------------------------------------------------------

    def match_prefix(self, token_ids: np.ndarray, user: str | None = None, rid: str | None = None) -> HiMatchResult:
        ids = as_token_ids(token_ids)
        values, node = self._walk(page_key(ids, self.page_size))
        host_hit_length, last_host = 0, node
        while node.value is None:
            assert node.host_value is not None and node.parent is not None
            host_hit_length += len(node.host_value)
            node = node.parent
        slots = self._slots(values)
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
        return HiMatchResult(slots, node, host_hit_length, last_host.backed_up_node())

    def walk_match(self, key: bytes, user: str | None = None) -> tuple[list[np.ndarray], HiTreeNode]:
        """Device values along the match of `key` and the last device node (request caching's re-match)."""
        values, node = self._walk(key)
        return values, node.device_node()

    def _walk(self, key: bytes) -> tuple[list[np.ndarray], HiTreeNode]:
        """The device values along the longest page-aligned match of `key` and its terminal node
        (device or host-only; split where the match ends inside a node); refreshes access times."""
        now = time.monotonic()
        node = self.tree.root
        node.last_access_time = now
        values: list[np.ndarray] = []
        pos, end = 0, len(key)
        while pos < end:
            child = node.children.get(key[pos : pos + self.page_bytes])
            if child is None:
                break
            child.last_access_time = now
            if not key.startswith(child.key, pos):
                child = self._split(child, common_page_len(child.key, key, pos, self.page_size))
                pos = end
            else:
                pos += len(child.key)
            if child.value is not None:
                values.append(child.value)
            node = child
        return values, node

    def _slots(self, values: list[np.ndarray]) -> torch.Tensor:
        if not values:
            return self._no_slots
        slots = torch.from_numpy(values[0] if len(values) == 1 else np.concatenate(values))
        return slots if self._on_cpu else slots.to(self.device)

    def _split(self, child: HiTreeNode, split_len: int) -> HiTreeNode:
        upper = split_hi_node(child, split_len, self.page_bytes, self.recorder)
        for op_id in (upper.write_op, upper.load_op):
            if op_id is not None:
                self._in_flight[op_id].nodes.append(upper)
        return upper

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
        """RadixCache.insert, except that a host-only node the key fully covers adopts the
        caller's slots (the recompute case): those are the tree's now and NOT counted in the
        returned prefix_len, so the caller does not free them."""
        ids = as_token_ids(token_ids)
        if slots.shape[0] != len(ids):
            raise CacheMisuseError(f"insert: {len(ids)} token ids but {slots.shape[0]} slots")
        key = page_key(ids, self.page_size)
        host = (slots.numpy() if self._on_cpu else slots.cpu().numpy())[: len(key) // TOKEN_BYTES]
        now = time.monotonic()
        node, pos, prefix_len = self.tree.root, 0, 0
        node.last_access_time = now
        while pos < len(key):
            child = node.children.get(key[pos : pos + self.page_bytes])
            if child is None:
                break
            child.last_access_time = now
            # NOTE: before a split, so both pieces take it (SGLang 0.5.18's HiRadixCache; its RadixCache
            # raises only the upper piece's)
            child.priority = max(child.priority, priority)
            if not key.startswith(child.key, pos):
                child = self._split(child, common_page_len(child.key, key, pos, self.page_size))
            start = pos // TOKEN_BYTES
            if child.value is None:
                self._adopt(child, np.array(host[start : start + child.key_len], dtype=np.int64))
            else:
                self._hit(child, chunked)
                prefix_len += child.key_len
            pos += len(child.key)
            node = child
        if pos < len(key):
            value = np.array(host[pos // TOKEN_BYTES :], dtype=np.int64)
            leaf = self._add_leaf(node, key[pos:], value, user, priority, rid)
            self._hit(leaf, chunked)
        return prefix_len

    def _add_leaf(
        self, parent: HiTreeNode, key: bytes, value: np.ndarray, user: str | None, priority: int, rid: str | None
    ) -> HiTreeNode:
        """A new device-only leaf (no hit yet: the caller counts it)."""
        self.tree.claim(value)
        leaf = HiTreeNode(key, value, time.monotonic())
        leaf.parent, leaf.owner, leaf.priority = parent, user, priority
        parent.children[key[: self.page_bytes]] = leaf
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
                principal=user,
            )
        return leaf

    def _detach(self, leaf: HiTreeNode) -> None:
        detach_child(leaf, self.page_bytes)

    # -- requests (the shared bookkeeping in tree/requests.py) ------------------------------

    def cache_unfinished_req(self, req: CacheableRequest, chunked: bool = False) -> None:
        cache_unfinished_req(self, req, chunked)

    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None:
        cache_finished_req(self, req, is_insert)

    def insert_unfinished(
        self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor, chunked: bool
    ) -> int:
        """The caller frees its duplicates: they end at the device prefix the tree already had."""
        return self.insert(token_ids, slots, user=req.user, chunked=chunked, rid=req.rid)

    def insert_finished(self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor) -> int:
        return self.insert(token_ids, slots, user=req.user, rid=req.rid)

    def _hit(self, node: HiTreeNode, chunked: bool) -> None:
        """SGLang's inc_hit_count: count a reuse and back the node up once it reaches the
        threshold. Chunked inserts and write_back count no hits."""
        if chunked or not self.through:
            return
        node.hit_count += 1
        self._maybe_write_through(node)

    def _maybe_write_through(self, node: HiTreeNode) -> None:
        parent = node.parent
        assert parent is not None
        if (
            self.through
            and node.host_value is None
            and node.hit_count >= self.write_through_threshold
            and parent.host_value is not None
        ):
            self.write_backup(node)

    def _adopt(self, node: HiTreeNode, value: np.ndarray) -> None:
        """A host-only node takes device slots (insert's recompute case, or a load)."""
        self.tree.claim(value)
        node.value = value
        assert node.parent is not None
        self.tree.count_new(node.parent, node, value)
        if self.recorder.enabled:  # NOTE: the slots are the node's now (the ledger moves them to the tree)
            self.recorder.record(
                EventKind.REVIVE, pool=PoolName.FULL, node_id=node.id, num_tokens=len(value), slots=value
            )

    # -- locks (a request's, or a copy op's until its ack) ---------------------------------

    def inc_lock_ref(self, node: HiTreeNode, rid: str | None = None) -> int | None:
        self._lock(node, rid, None, 0)
        return None

    def dec_lock_ref(self, node: HiTreeNode, lock_id: int | None = None, rid: str | None = None) -> None:
        self._unlock(node, rid, None, 0)

    def _lock(self, node: HiTreeNode, rid: str | None, copy: CopyKind | None, op_id: int) -> None:
        """+1 lock_ref node -> root, for request `rid` or for copy op `op_id` of kind `copy`."""
        moved = self.tree.lock(node)
        if self.recorder.enabled:
            self.recorder.record(EventKind.LOCK, rid=rid, node_id=node.id, num_tokens=moved, reason=copy, aux=op_id)

    def _unlock(self, node: HiTreeNode, rid: str | None, copy: CopyKind | None, op_id: int) -> None:
        moved = self.tree.unlock(node)
        if self.recorder.enabled:
            self.recorder.record(EventKind.UNLOCK, rid=rid, node_id=node.id, num_tokens=moved, reason=copy, aux=op_id)

    # -- writes (device -> host) -----------------------------------------------------------

    def write_backup(self, node: HiTreeNode, lock: bool = True) -> int:
        """Copy a device node to the host; evict host-only leaves once if the host is full.
        Through policies lock the node until writing_check() sees the ack. Returns the tokens
        backed up (0: the host could not take them)."""
        assert node.value is not None and node.host_value is None
        op_id = next(self._op_ids)
        device_slots = torch.from_numpy(node.value)
        device_slots = device_slots if self._on_cpu else device_slots.to(self.device)
        host_slots = self.controller.write(device_slots, op_id)
        if host_slots is None:
            self.evict_host(len(node.value))
            host_slots = self.controller.write(device_slots, op_id)
        if host_slots is None:
            return 0
        node.host_value = host_slots
        node.write_op = op_id
        self._host_size += len(host_slots)
        self._in_flight[op_id] = InFlight("write", node if lock else None, [node], len(host_slots))
        self.num_write_tokens += len(host_slots)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.WRITE,
                pool=PoolName.HOST,
                node_id=node.id,
                num_tokens=len(host_slots),
                slots=host_slots,
                aux=op_id,
            )
        if lock:
            self._lock(node, None, CopyKind.WRITE, op_id)
        return len(host_slots)

    def writing_check(self) -> list[int]:
        """Release the nodes whose writes the controller acknowledged; returns those op ids."""
        done = self.controller.writing_check()
        for op_id in done:
            self._finish(op_id)
        return done

    def loading_check(self) -> list[int]:
        """Release the nodes (and unpin the host copies) whose loads were acknowledged."""
        done = self.controller.loading_check()
        for op_id in done:
            self._finish(op_id)
        return done

    def _finish(self, op_id: int) -> None:
        op = self._in_flight.pop(op_id)
        for node in op.nodes:
            if op.kind == "write":
                node.write_op = None
            else:
                node.load_op = None
                node.host_ref_counter -= 1
        copy = CopyKind(op.kind)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.ACK,
                pool=PoolName.HOST if copy is CopyKind.WRITE else PoolName.FULL,
                node_id=op.nodes[0].id,
                num_tokens=op.num_tokens,
                reason=copy,
                aux=op_id,
            )
        if op.lock_node is not None:
            self._unlock(op.lock_node, None, copy, op_id)

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # -- device eviction -------------------------------------------------------------------

    def refresh_eviction_order(self) -> None:
        """Re-key every evictable leaf (after editing node fields by hand; see RadixCache)."""
        self.tree.heap.rebuild(self.tree.evictable_leaves)

    def evict(self, params: EvictParams) -> EvictResult:
        return EvictResult(self.evict_tokens(params.num_tokens, params.swa_num_tokens))

    def evict_tokens(self, num_tokens: int, swa_num_tokens: int = 0) -> int:
        """Free at least num_tokens device tokens: backed-up leaves are demoted to host-only,
        others deleted (write_back: written to the host first, or dropped with their subtree
        when the host cannot take them)."""
        self.tree.check_evictable(num_tokens, swa_num_tokens)
        if num_tokens <= 0:
            return 0
        self._staged.clear()
        try:
            freed = self.tree.evict_leaves(num_tokens, self._evict_leaf)
        finally:
            self._unpin_staged()
        staged = {id(chunk) for chunk in self._staged}
        # NOTE: SGLang 0.5.18 frees each evicted leaf with allocator.free (its pages sorted, put in
        # front), in eviction order; write_back frees the leaves it wrote to the host last, at a
        # flush: before a leaf it drops, and at the end (its flush_staged)
        pending: list[np.ndarray] = []
        for chunk in freed:
            if id(chunk) in staged:
                pending.append(chunk)
                continue
            if pending and chunk is self._dropped.get(id(chunk)):
                self._flush_staged(pending)
            self._free_leaf_slots(chunk)
        self._flush_staged(pending)
        self._dropped.clear()
        return sum(len(chunk) for chunk in freed)

    def _free_leaf_slots(self, chunk: np.ndarray) -> None:
        self.allocator.free(torch.from_numpy(chunk).to(self.allocator.device))

    def _flush_staged(self, pending: list[np.ndarray]) -> None:
        """The leaves written to the host during this eviction: their copies done, their device slots freed."""
        if not pending:
            return
        self.controller.wait_all()  # NOTE: the written rows must be copied before their device slots are reused
        self.writing_check()
        for chunk in pending:
            self._free_leaf_slots(chunk)
        pending.clear()

    def _unpin_staged(self) -> None:
        """SGLang's flush_staged releases the host copies of the leaves it wrote (their device
        frees are replayed in evict_tokens' second pass)."""
        for node in self._pinned:
            node.host_ref_counter -= 1
        self._pinned.clear()

    def _evict_leaf(self, leaf: HiTreeNode, want: int) -> np.ndarray | None:
        """Demote a backed-up leaf, or drop one the host has no copy of (write_back writes it
        first); None when a load still reads a host copy below it."""
        del want  # NOTE: whole leaves only
        written = False
        if leaf.host_value is None and not self.through:
            written = self.write_backup(leaf, lock=False) > 0
            if not written:
                self._unpin_staged()  # NOTE: SGLang flushes the staged leaves before it drops one
            if leaf.host_value is None and any(n.host_ref_counter for n, _, _ in hi_walk(leaf)):
                return None  # NOTE: a load reads a host copy below: neither written nor droppable now
        backed_up = leaf.host_value is not None
        if self.recorder.enabled:
            reason = EvictReason.TO_HOST if backed_up else EvictReason.DROP if not self.through else self.evict_reason
            self.recorder.record(
                EventKind.EVICT,
                pool=PoolName.FULL,
                node_id=leaf.id,
                num_tokens=leaf.key_len,
                slots=leaf.value,
                reason=reason,
            )
        if backed_up:
            chunk = self._demote(leaf)
            if written:
                self._staged.append(chunk)  # NOTE: freed at the flush, once its copy is done
                leaf.host_ref_counter += 1  # NOTE: until then a host eviction must not free its copy
                self._pinned.append(leaf)
            return chunk
        chunk = self._drop(leaf)
        if not self.through:
            self._dropped[id(chunk)] = chunk  # NOTE: a write_back drop flushes the staged leaves first
        return chunk

    def _demote(self, leaf: HiTreeNode) -> np.ndarray:
        """A backed-up device leaf becomes host-only; returns its device slots (the caller frees)."""
        value = leaf.value
        assert value is not None and leaf.lock_ref == 0
        leaf.value = None
        self.tree.evictable_leaves.discard(leaf)
        self.tree.evictable_len -= len(value)
        self.tree.release(value)
        assert leaf.parent is not None
        self.tree.mark_leaf(leaf.parent)
        return value

    def _drop(self, leaf: HiTreeNode) -> np.ndarray:
        """Delete a device leaf that has no host copy, with its host-only subtree (write_back's
        host pressure: its device tokens are counted as dropped); returns its device slots (the
        caller frees)."""
        below: list[HiTreeNode] = []
        stack = list(leaf.children.values())
        while stack:  # NOTE: SGLang's order (its stack takes the last child first): the host frees follow it
            node = stack.pop()
            below.append(node)
            stack.extend(node.children.values())
        for node in below:
            assert node.host_value is not None and node.host_ref_counter == 0
            self._free_host_copy(node, EvictReason.DROP)
        if not self.through:
            self.num_dropped_tokens += leaf.key_len
        leaf.children = {}
        return self.tree.delete_leaf(leaf)

    # -- host eviction ---------------------------------------------------------------------

    def host_evictable_leaves(self) -> list[HiTreeNode]:
        """Host-only nodes with lock_ref 0, no children (every child of a host-only node is
        backed up) and no in-flight load pin."""
        return [n for n, _, _ in hi_walk(self.root) if self._host_evictable(n)]

    def _host_evictable(self, node: HiTreeNode) -> bool:
        return (
            node.value is None
            and node is not self.root
            and node.lock_ref == 0
            and not node.children
            and node.host_ref_counter == 0
        )

    def evict_host(self, num_tokens: int) -> int:
        """Free at least num_tokens host tokens (whole leaves; fewer when nothing else is
        evictable) from host-only leaves in policy order; returns the tokens freed."""
        heap = [(self.policy.key(n), n.id, n) for n in self.host_evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            assert node.host_value is not None and node.parent is not None
            evicted += len(node.host_value)
            self._free_host_copy(node, self.evict_reason)
            parent = node.parent
            del parent.children[node.key[: self.page_bytes]]
            node.parent = None
            if self._host_evictable(parent):
                heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        return evicted

    def _free_host_copy(self, node: HiTreeNode, reason: EvictReason) -> None:
        """A host-only node's copy leaves the tree (the caller unlinks the node): host_evict, then
        the host allocator's free (unless the free hook takes it over)."""
        host_value = node.host_value
        assert host_value is not None
        self._host_size -= len(host_value)
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.HOST_EVICT,
                pool=PoolName.HOST,
                node_id=node.id,
                num_tokens=len(host_value),
                slots=host_value,
                reason=reason,
            )
        if self.on_host_free is None or not self.on_host_free(node, host_value):
            self.host_allocator.free(host_value)

    # -- load back (host -> device) --------------------------------------------------------

    def load_back(self, node: HiTreeNode, mem_quota: int | None = None) -> torch.Tensor | None:
        """Load the host-only chain ending at `node` up to its first device ancestor, all or
        nothing: refused below LOAD_BACK_MIN_TOKENS or above mem_quota (plus the evictable
        tokens the temporary ancestor lock takes away); on device OOM, evict once and retry.
        On success each node takes its share of the new device slots, and `node` stays locked
        (its host copies pinned) until loading_check() sees the ack. Returns the device slots."""
        chain: list[HiTreeNode] = []
        ancestor = node
        while ancestor.value is None:
            chain.append(ancestor)
            assert ancestor.parent is not None
            ancestor = ancestor.parent
        chain.reverse()
        host_slots = np.concatenate([n.host_value for n in chain]) if chain else EMPTY_HOST
        before = self.tree.evictable_len
        self.inc_lock_ref(ancestor)
        quota_delta = self.tree.evictable_len - before
        over_quota = mem_quota is not None and len(host_slots) > mem_quota + quota_delta
        if len(host_slots) < LOAD_BACK_MIN_TOKENS or over_quota:
            self.dec_lock_ref(ancestor)
            return None
        for n in chain:
            n.host_ref_counter += 1  # NOTE: pinned: an eviction below (write_back) may evict host leaves
        op_id = next(self._op_ids)
        device_slots = self.controller.load(host_slots, op_id)
        if device_slots is None and self.tree.evictable_len > 0:
            self.num_load_evicted_tokens += self.evict_tokens(min(len(host_slots), self.tree.evictable_len))
            device_slots = self.controller.load(host_slots, op_id)
        self.dec_lock_ref(ancestor)
        if device_slots is None:
            for n in chain:
                n.host_ref_counter -= 1
            return None
        self._place_loaded(chain, device_slots, op_id)
        return device_slots

    def _place_loaded(self, chain: list[HiTreeNode], device_slots: torch.Tensor, op_id: int) -> None:
        values = device_slots.cpu().numpy().astype(np.int64, copy=False)
        offset = 0
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.LOAD,
                pool=PoolName.FULL,
                node_id=chain[-1].id,
                num_tokens=len(values),
                slots=values,
                aux=op_id,
            )
        for node in chain:
            self._adopt(node, values[offset : offset + node.key_len].copy())
            offset += node.key_len
            node.load_op = op_id
        self._in_flight[op_id] = InFlight("load", chain[-1], list(chain), offset)
        self.num_load_back_tokens += offset
        self._lock(chain[-1], None, CopyKind.LOAD, op_id)

    def init_load_back(
        self, last_host_node: HiTreeNode, host_hit_length: int, mem_quota: int | None = None
    ) -> tuple[torch.Tensor, HiTreeNode]:
        """As the PrefillAdder calls it after a match: (the loaded device slots, to append to the
        request's prefix, and the request's new last node). Nothing loaded: (empty, the last
        device node)."""
        del host_hit_length  # NOTE: SGLang passes it and does not use it either
        node = last_host_node
        if node.value is None:
            loaded = self.load_back(node, mem_quota)
            if loaded is not None:
                return loaded, node
        return self._no_slots, node.device_node()

    # -- views -----------------------------------------------------------------------------

    def tree_slots(self) -> np.ndarray:
        values = [n.value for n, _, _ in hi_walk(self.root) if n is not self.root and n.value is not None]
        return np.concatenate(values) if values else EMPTY_HOST

    def tree_host_slots(self) -> np.ndarray:
        values = [n.host_value for n, _, _ in hi_walk(self.root) if n is not self.root and n.host_value is not None]
        return np.concatenate(values) if values else EMPTY_HOST

    def check_integrity(self) -> None:
        """The radix invariants over device nodes, and the tier invariants of the module NOTE."""
        nodes = [(n, start) for n, _, start in hi_walk(self.root) if n is not self.root]
        device = [(n, start) for n, start in nodes if n.value is not None]
        for node, start in device:
            check_node_shape(node, start, self.page_size)
        for node, _ in nodes:
            self._check_tiers(node)
        self.tree.check([n for n, _ in device])  # NOTE: counts, evictable leaves, device slots
        host_slots = self.tree_host_slots()
        check_sizes("host", (len(host_slots),), (self._host_size,))
        self.host_allocator.check_integrity(held=host_slots)
        self._check_in_flight()

    def _check_tiers(self, node: HiTreeNode) -> None:
        parent = node.parent
        busy = node.host_value is None or node.lock_ref or node.load_op is not None or node.write_op is not None
        if node.value is None and busy:
            raise IntegrityError(
                f"host-only node {node.id}: host_value {node.host_value is not None}, "
                f"lock_ref {node.lock_ref}, ops {node.write_op}/{node.load_op}"
            )
        if parent is None:
            raise IntegrityError(f"node {node.id} is walked in the tree but has no parent")
        if node.value is None:
            if parent.children.get(node.key[: self.page_bytes]) is not node:
                raise IntegrityError(f"host-only node {node.id} is not its parent's child under its first page")
        elif parent.value is None:
            raise IntegrityError(f"device node {node.id} under host-only node {parent.id}")
        if node.host_value is not None and (len(node.host_value) != node.key_len or node.key_len % self.page_size):
            raise IntegrityError(f"node {node.id}: {len(node.host_value)} host slots for {node.key_len} tokens")
        if self.through and node.host_value is not None and parent.host_value is None:
            raise IntegrityError(f"backed-up node {node.id} under node {parent.id}, which is not backed up")
        if node.host_ref_counter != (node.load_op is not None):
            raise IntegrityError(f"node {node.id}: host_ref_counter {node.host_ref_counter}, load op {node.load_op}")

    def _check_in_flight(self) -> None:
        for op_id, op in self._in_flight.items():
            for node in op.nodes:
                if (node.write_op if op.kind == "write" else node.load_op) != op_id:
                    raise IntegrityError(f"node {node.id} listed in {op.kind} op {op_id} does not carry it")
            if op.lock_node is not None and op.lock_node.lock_ref <= 0:
                raise IntegrityError(f"{op.kind} op {op_id} in flight but node {op.lock_node.id} is unlocked")

    def pretty_print(self) -> str:
        def tier_and_copies(node: HiTreeNode) -> str:
            return node.tier + "".join(
                f" {k}={v}" for k, v in (("writing", node.write_op), ("loading", node.load_op)) if v
            )

        return render(self.root, extra=tier_and_copies)

    def export_nodes(self, preview_tokens: int = 8) -> list[NodeRow]:
        """The flat node table; num_tokens counts a node's key on whichever tier holds it."""
        walked = hi_walk(self.root)
        hashes = page_hashes(walked, self.page_size, self._page_hash_memo)
        return [
            NodeRow(
                node_id=node.id,
                parent_id=None if node.parent is None else node.parent.id,
                num_tokens=node.key_len,
                token_preview=preview(node, preview_tokens),
                lock_ref=node.lock_ref,
                last_access_time=node.last_access_time,
                hit_count=node.hit_count,
                owner=node.owner,
                tombstone=False,
                depth_tokens=start + node.key_len,
                visibility="public",
                tier=node.tier,
                page_hashes=hashes[node.id],
            )
            for node, _, start in walked
        ]
