"""Differential: kvscope's HiRadixCache against SGLang 0.5.18's own HiRadixCache, on random
workloads: every write policy, every eviction policy, page size 1 and 4, a roomy and a tight host pool
(docs/memory-semantics.md §2.8, §7).

SGLang's class runs as written over tests/engines/sglang_hicache_standin.py: its controller's
copies are synchronous, and acknowledged when the test calls the checks (the NOTE there says
what each stand-in keeps of the real controller and host pool). kvscope's runs over its real
CacheController, device KV pool and host pool on the CPU.

NOTE: one request of the replay (prompt P, all_ids A = P + outputs, s = |A|), fed to both:
    match      m = match_prefix(P)                      same device slots, same host hit length
    load back  now and then, when m has a host hit:     same loaded slots (or both nothing)
               init_load_back(m's last host node, a memory quota or none)
    lock       the request's last node
    evict      if fewer than page_ceil(s) - p are free: evict(the shortfall, clamped to the
               evictable size)                          same count
    alloc      page size 1: alloc(s - p); else alloc_extend   same slots (or both None)
    insert     insert(A, slots, chunked, priority)      same prefix length
    free       the duplicates [p, prefix) and the sub-page tail (cache_finished_req's frees)
    unlock     at once, or later: some requests keep their lock a while
Between requests, now and then: the write acks (writing_check), the load acks (SGLang's
start_loading, the forward's, then loading_check), a bare match, a bare device eviction, a
host eviction. After every step: the same device free lists, the same host free slots in
the same order, sizes, in-flight ops, and the same tree node for node (path, device slots,
host slots, lock_ref, hit_count, priority) with the evictable leaves in the same order by
access and by creation (tests/engines/differential.py's clock).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvscope.cache.hiradix.cache as hiradix_module
from kvscope.cache import EvictParams
from kvscope.cache.base import TOKEN_DTYPE
from kvscope.cache.hiradix import HiRadixCache
from kvscope.cache.tree.eviction import POLICIES
from kvscope.mem import (
    CacheController,
    HostKVPool,
    HostTokenAllocator,
    MHATokenToKVPool,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from tests.engines.differential import same_free_lists, slots_alloc, tick_clock, tokens
from tests.engines.sglang518 import needs_source, sglang_518_source
from tests.engines.sglang_hicache_standin import DevicePool, load_sglang_518_hiradix, make_hiradix

SRC = sglang_518_source()
pytestmark = needs_source(SRC)


@functools.cache
def sglang() -> types.SimpleNamespace:
    assert SRC is not None
    return load_sglang_518_hiradix(SRC)


Tree = tuple[dict[tuple[int, ...], tuple[Any, ...]], list[tuple[int, ...]], list[tuple[int, ...]]]


def as_list(slots: Any) -> list[int] | None:
    return None if slots is None else [int(s) for s in slots]


def tree_view(root: Any, key_tokens: Any, leaves: Any) -> Tree:
    """({path: (device slots, host slots, lock_ref, hit_count, priority)}, the evictable device
    leaves' paths by last access, the same by creation)."""
    nodes: dict[tuple[int, ...], tuple[Any, ...]] = {}
    paths: dict[int, tuple[int, ...]] = {}
    stack = [(child, ()) for child in root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + tuple(key_tokens(node))
        paths[id(node)] = path
        nodes[path] = (as_list(node.value), as_list(node.host_value), node.lock_ref, node.hit_count, node.priority)
        stack.extend((child, path) for child in node.children.values())
    by_access = [paths[id(n)] for n in sorted(leaves, key=lambda n: n.last_access_time)]
    by_creation = [paths[id(n)] for n in sorted(leaves, key=lambda n: n.creation_time)]
    return nodes, by_access, by_creation


class Pair:
    """The same two-tier cache twice: kvscope's and SGLang 0.5.18's."""

    def __init__(self, page_size: int, write_policy: str, policy: str, host_ratio: float) -> None:
        sgl = self.sgl = sglang()
        self.ps, size = page_size, 48 * page_size
        self.sg_alloc: Any
        if page_size == 1:
            self.kv_alloc: Any = TokenToKVPoolAllocator(size, "cpu", strict=True)
            self.sg_alloc = sgl.TokenToKVPoolAllocator(size, torch.int64, "cpu", DevicePool(size), False)
        else:
            self.kv_alloc = PagedTokenToKVPoolAllocator(size, page_size, "cpu", strict=True)
            self.sg_alloc = sgl.PagedTokenToKVPoolAllocator(
                size, page_size, torch.int64, "cpu", DevicePool(size), False
            )
        self.sg = make_hiradix(sgl, self.sg_alloc, page_size, write_policy, policy, host_ratio)
        self.sg_host = self.sg.token_to_kv_pool_host
        host_size = self.sg_host.size
        device_kv = MHATokenToKVPool(size, page_size, torch.float32, 1, 2, 1, "cpu")
        self.kv_host = HostTokenAllocator(host_size, page_size, strict=True)
        controller = CacheController(
            self.kv_alloc, device_kv, self.kv_host, HostKVPool.like(device_kv, host_size, pin_memory=False)
        )
        self.kv = HiRadixCache(
            self.kv_alloc, page_size, controller, write_policy=write_policy, eviction_policy=policy, strict=True
        )  # type: ignore[arg-type]
        self.held: list[tuple[Any, Any]] = []

    def key(self, ids: np.ndarray) -> Any:
        return self.sgl.RadixKey([int(t) for t in ids])

    def same(self, where: str) -> None:
        same_free_lists(self.kv_alloc, self.sg_alloc, where)
        assert self.kv_host.free_slot_ids().tolist() == self.sg_host.slots_in_free_order(), f"{where}: host free"
        assert (self.kv.evictable_size(), self.kv.protected_size()) == (
            self.sg.evictable_size(),
            self.sg.protected_size(),
        ), f"{where}: sizes"
        assert self.kv.num_in_flight() == len(self.sg.ongoing_write_through) + len(self.sg.ongoing_load_back), where
        mine = tree_view(
            self.kv.root,
            lambda n: np.frombuffer(n.key, dtype=TOKEN_DTYPE).tolist(),
            self.kv.tree.evictable_leaves,
        )
        theirs = tree_view(self.sg.root_node, lambda n: [int(t) for t in n.key.token_ids], self.sg.evictable_leaves)
        assert mine[0] == theirs[0], f"{where}: tree"
        assert mine[1:] == theirs[1:], f"{where}: evictable leaves"
        self.kv.check_integrity()

    def match(self, prompt: np.ndarray, where: str) -> tuple[Any, Any]:
        mine = self.kv.match_prefix(prompt)
        theirs = self.sg.match_prefix(self.sgl.MatchPrefixParams(key=self.key(prompt)))
        assert mine.device_indices.tolist() == theirs.device_indices.tolist(), where
        assert mine.host_hit_length == theirs.host_hit_length, where
        return mine, theirs

    def load_back(self, mine: Any, theirs: Any, quota: int | None, where: str) -> tuple[torch.Tensor, Any, Any]:
        got, kv_node = self.kv.init_load_back(mine.last_host_node, mine.host_hit_length, quota)
        want, sg_node = self.sg.init_load_back(
            self.sgl.InitLoadBackParams(
                best_match_node=theirs.best_match_node, host_hit_length=theirs.host_hit_length, mem_quota=quota
            )
        )
        assert got.tolist() == want.tolist(), f"{where}: loaded"
        return got, kv_node, sg_node

    def evict(self, num_tokens: int, where: str) -> None:
        got = self.kv.evict(EvictParams(num_tokens)).num_tokens_evicted
        want = self.sg.evict(self.sgl.EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        assert got == want, f"{where}: evicted"

    def serve(self, prompt: np.ndarray, all_ids: np.ndarray, how: dict[str, Any], where: str) -> None:
        mine, theirs = self.match(prompt, where)
        prefix, kv_node, sg_node = mine.device_indices, mine.last_node, theirs.last_device_node
        if mine.host_hit_length and how["load"]:
            loaded, kv_node, sg_node = self.load_back(mine, theirs, how["quota"], where)
            prefix = torch.cat((prefix, loaded))
        self.kv.inc_lock_ref(kv_node)
        self.sg.inc_lock_ref(sg_node)
        p, s, ps = len(prefix), len(all_ids), self.ps
        short = -(-s // ps) * ps - p - self.kv_alloc.available_size()
        if short > 0 and self.kv.evictable_size():
            self.evict(min(short, self.kv.evictable_size()), f"{where}: evict")
        new_kv, new_sg = slots_alloc(self.kv_alloc, self.sg_alloc, ps, p, s, int(prefix[-1]) if p else -1)
        assert (new_kv is None) == (new_sg is None), where
        if new_kv is not None and new_sg is not None:
            assert new_kv.tolist() == new_sg.tolist(), where
            self.insert(all_ids, torch.cat((prefix, new_kv)), p, how, where)
        self.held.append((kv_node, sg_node))
        if not how["hold"]:
            self.release(len(self.held) - 1)

    def insert(self, all_ids: np.ndarray, slots: torch.Tensor, p: int, how: dict[str, Any], where: str) -> None:
        key_len = len(all_ids) // self.ps * self.ps
        chunked, priority = bool(how["chunked"]), int(how["priority"])
        got = self.kv.insert(all_ids, slots, chunked=chunked, priority=priority)
        want = self.sg.insert(
            self.sgl.InsertParams(
                key=self.key(all_ids), value=slots[:key_len].clone(), chunked=chunked, priority=priority
            )
        ).prefix_len
        assert got == want, f"{where}: prefix_len"
        for alloc in (self.kv_alloc, self.sg_alloc):
            alloc.free_segments([(slots[p:got].clone(), p), (slots[key_len:].clone(), key_len)])

    def release(self, i: int) -> None:
        kv_node, sg_node = self.held.pop(i)
        self.kv.dec_lock_ref(kv_node)
        self.sg.dec_lock_ref(sg_node)

    def writing_check(self) -> None:
        self.kv.writing_check()
        self.sg.writing_check()

    def loading_check(self) -> None:
        self.kv.loading_check()
        self.sg.cache_controller.start_loading()  # NOTE: the forward's; it queues the loads' ack
        self.sg.loading_check()

    def evict_host(self, num_tokens: int) -> None:
        self.kv.evict_host(num_tokens)
        self.sg.evict_host(num_tokens)  # NOTE: returns nothing in 0.5.18: the host free lists tell


@settings(max_examples=60, deadline=None)
@given(
    write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    policy=st.sampled_from(sorted(POLICIES)),
    page_size=st.sampled_from([1, 4]),
    host_ratio=st.sampled_from([0.5, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_hiradix_cache_matches_sglang_0_5_18_slot_for_slot(
    write_policy: str, policy: str, page_size: int, host_ratio: float, seed: int
) -> None:
    sgl = sglang()
    rng = np.random.default_rng(seed)
    with tick_clock(hiradix_module, *sgl.modules):
        pair = Pair(page_size, write_policy, policy, host_ratio)
        pair.same("start")
        seen: list[np.ndarray] = []
        for i in range(40):
            all_ids = tokens(rng, seen, longest=48)
            seen.append(all_ids)
            how = {
                "chunked": rng.random() < 0.1,
                "priority": int(rng.integers(0, 3)),
                "hold": len(pair.held) < 3 and rng.random() < 0.3,
                "load": rng.random() < 0.7,
                "quota": None if rng.random() < 0.7 else int(rng.integers(0, 48 * page_size)),
            }
            pair.serve(all_ids[: max(1, len(all_ids) - int(rng.integers(0, 8)))], all_ids, how, f"request {i}")
            pair.same(f"request {i}")
            if rng.random() < 0.5:
                pair.writing_check()
                pair.same(f"after request {i}: writing_check")
            if rng.random() < 0.5:
                pair.loading_check()
                pair.same(f"after request {i}: loading_check")
            if pair.held and rng.random() < 0.3:
                pair.release(int(rng.integers(len(pair.held))))
            if rng.random() < 0.3:
                probe = seen[rng.integers(len(seen))]
                pair.match(probe[: rng.integers(1, len(probe) + 1)], f"after request {i}: match")
            if rng.random() < 0.2 and pair.kv.evictable_size():
                pair.evict(int(rng.integers(1, pair.kv.evictable_size() + 1)), f"after request {i}: evict")
            if rng.random() < 0.1:
                pair.evict_host(int(rng.integers(1, 32)))
            pair.same(f"after request {i}")
