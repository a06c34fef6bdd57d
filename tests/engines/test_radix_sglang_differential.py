"""Differential: kvscope's RadixCache and token allocators against SGLang 0.5.18's own RadixCache,
TokenToKVPoolAllocator and PagedTokenToKVPoolAllocator, on random workloads, every eviction
policy both offer, page size 1 and paged, with and without need_sort (docs/memory-semantics.md
§2.3-2.5, §4).

NOTE: one request of the replay (prompt P, all_ids A = P + outputs, s = |A|), fed to both:
    match     m = match_prefix(P)                           same slots
    lock      inc_lock_ref(m.last_node)
    evict     if fewer than need = page_ceil(s) - p are free: evict(the shortfall, clamped to the
              evictable size)                               same count (leaf eviction, SGLang's)
    alloc     page size 1: alloc(s - p); else alloc_extend  same slots (or both None)
    insert    insert(A, slots, chunked, priority)           same prefix length
    free      the duplicates [p, prefix) and the sub-page tail, by free_segments, as
              cache_finished_req does (some requests inside a free group)
    unlock    dec_lock_ref(m.last_node), or later: some requests keep their lock a while
Between requests, now and then a bare match of a random prefix (it splits and stamps) and a
bare eviction. After every step: the same free lists, sizes, and the same tree node for node
(path, slots, lock_ref, hit_count, priority) and the evictable leaves in the same order by
access and by creation (tests/engines/differential.py's clock).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvscope.cache.radix.cache as radix_module
from kvscope.cache import EvictParams, RadixCache
from kvscope.cache.tree.eviction import POLICIES
from tests.engines.differential import (
    allocators,
    kvscope_tree,
    same_free_lists,
    sglang_tree,
    slots_alloc,
    tick_clock,
    tokens,
)
from tests.engines.sglang518 import load_sglang_518, needs_source, sglang_518_source

SRC = sglang_518_source()
pytestmark = needs_source(SRC)


def test_kvscope_offers_the_policies_sglang_0_5_18_does() -> None:
    assert SRC is not None
    assert sorted(POLICIES) == load_sglang_518(SRC).policies


class Pair:
    """The same allocator and cache twice: kvscope's and SGLang 0.5.18's."""

    def __init__(self, sgl: object, page_size: int, policy: str, size: int, need_sort: bool) -> None:
        self.sgl, self.ps = sgl, page_size
        self.kv_alloc, self.sg_alloc = allocators(sgl, page_size, size, need_sort)
        self.kv = RadixCache(self.kv_alloc, page_size, eviction_policy=policy, strict=True)
        self.sg = sgl.RadixCache(
            sgl.CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.sg_alloc,
                page_size=page_size,
                eviction_policy=policy,
            )
        )
        self.held: list[tuple[object, object]] = []

    def key(self, ids: np.ndarray) -> object:
        return self.sgl.RadixKey([int(t) for t in ids])

    def same(self, where: str) -> None:
        same_free_lists(self.kv_alloc, self.sg_alloc, where)
        assert (self.kv.evictable_size(), self.kv.protected_size()) == (
            self.sg.evictable_size(),
            self.sg.protected_size(),
        ), where
        assert kvscope_tree(self.kv.root) == sglang_tree(self.sg.root_node), where
        self.kv.check_integrity()

    def match(self, prompt: np.ndarray, where: str) -> tuple[object, object, torch.Tensor]:
        mine = self.kv.match_prefix(prompt)
        theirs = self.sg.match_prefix(self.sgl.MatchPrefixParams(key=self.key(prompt)))
        assert mine.device_indices.tolist() == theirs.device_indices.tolist(), where
        return mine.last_node, theirs.last_device_node, mine.device_indices

    def evict(self, num_tokens: int, where: str) -> None:
        got = self.kv.evict(EvictParams(num_tokens)).num_tokens_evicted
        want = self.sg.evict(self.sgl.EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        assert got == want, where

    def serve(self, prompt: np.ndarray, all_ids: np.ndarray, how: dict[str, object], where: str) -> None:
        kv_node, sg_node, prefix = self.match(prompt, where)
        self.kv.inc_lock_ref(kv_node)
        self.sg.inc_lock_ref(sg_node)
        p, s, ps = len(prefix), len(all_ids), self.ps
        short = -(-s // ps) * ps - p - self.kv_alloc.available_size()
        if short > 0 and self.kv.evictable_size():
            self.evict(min(short, self.kv.evictable_size()), f"{where}: evict")
        mine, theirs = slots_alloc(self.kv_alloc, self.sg_alloc, ps, p, s, int(prefix[-1]) if p else -1)
        assert (mine is None) == (theirs is None), where
        if mine is not None and theirs is not None:
            assert mine.tolist() == theirs.tolist(), where
            self.insert(all_ids, torch.cat((prefix, mine)), p, how, where)
        self.held.append((kv_node, sg_node))
        if not how["hold"]:
            self.release(len(self.held) - 1)

    def insert(self, all_ids: np.ndarray, slots: torch.Tensor, p: int, how: dict[str, object], where: str) -> None:
        key_len = len(all_ids) // self.ps * self.ps
        chunked, priority = bool(how["chunked"]), int(how["priority"])  # type: ignore[call-overload]
        got = self.kv.insert(all_ids, slots, chunked=chunked, priority=priority)
        want = self.sg.insert(
            self.sgl.InsertParams(
                key=self.key(all_ids), value=slots[:key_len].clone(), chunked=chunked, priority=priority
            )
        ).prefix_len
        assert got == want, where
        for alloc in (self.kv_alloc, self.sg_alloc):
            if how["grouped"]:
                alloc.free_group_begin()
            alloc.free_segments([(slots[p:got].clone(), p), (slots[key_len:].clone(), key_len)])
            if how["grouped"]:
                alloc.free_group_end()

    def release(self, i: int) -> None:
        kv_node, sg_node = self.held.pop(i)
        self.kv.dec_lock_ref(kv_node)
        self.sg.dec_lock_ref(sg_node)


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    page_size=st.sampled_from([1, 2, 4]),
    need_sort=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_radix_cache_matches_sglang_0_5_18_slot_for_slot(
    policy: str, page_size: int, need_sort: bool, seed: int
) -> None:
    assert SRC is not None
    sgl = load_sglang_518(SRC)
    rng = np.random.default_rng(seed)
    with tick_clock(radix_module, sgl.radix_module):
        pair = Pair(sgl, page_size, policy, 64 * page_size, need_sort)
        seen: list[np.ndarray] = []
        for i in range(50):
            all_ids = tokens(rng, seen)
            seen.append(all_ids)
            how = {
                "chunked": rng.random() < 0.15,
                "priority": int(rng.integers(0, 3)),
                "grouped": rng.random() < 0.3,
                "hold": len(pair.held) < 3 and rng.random() < 0.3,
            }
            pair.serve(all_ids[: max(1, len(all_ids) - int(rng.integers(0, 8)))], all_ids, how, f"request {i}")
            pair.same(f"request {i}")
            if pair.held and rng.random() < 0.3:
                pair.release(int(rng.integers(len(pair.held))))
            if rng.random() < 0.3:
                probe = seen[rng.integers(len(seen))]
                pair.match(probe[: rng.integers(1, len(probe) + 1)], f"after request {i}: match")
            if rng.random() < 0.15 and pair.kv.evictable_size():
                pair.evict(int(rng.integers(1, pair.kv.evictable_size() + 1)), f"after request {i}: evict")
            pair.same(f"after request {i}")
