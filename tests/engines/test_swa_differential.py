"""Differential: kvscope's SWARadixCache and SWA allocator against SGLang 0.5.18's own classes,
request by request, on random workloads (docs/memory-semantics.md §2.6, §5).

NOTE: one request of the replay (prompt P, all_ids A = P + outputs, s = |A|), fed to both:
    match     m = match_prefix(P)                         same prefix length, same slots
    lock      inc_lock_ref(m.last_node)
    evict     if a pool has fewer than need = ceil_ps(s) - p free: evict(full, swa shortfalls,
              each clamped to its evictable size)          same SWA count, same free lists
    alloc     page size 1: alloc(s - p); else alloc_extend  same slots (or both None)
    window    free_swa(slots[p:e]) with e = page_floor(s - max(window, ps)) when e > p
    insert    insert(A[:key_len], prev_prefix_len=p, swa_evicted_len=max(e, p)), then free the
              sub-page tail                                 same return value
    unlock    dec_lock_ref(m.last_node, the window lock id), or later: some requests keep their
              lock over the next requests (as running ones do), so tombstones under a full lock
              get revived too
Between requests, now and then an SWA-only eviction (tombstones). Some requests run inside a
free group. After every step: both pools' free lists and the full -> SWA mapping are equal.
Full evicted counts may differ only as §14.1 says: kvscope's is at least SGLang's.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvscope.cache import EvictParams
from kvscope.cache.swa_radix import SWARadixCache
from kvscope.mem import SWATokenToKVPoolAllocator
from tests.engines.differential import slots_alloc, tokens
from tests.engines.sglang518 import load_sglang_518, needs_source, sglang_518_source

SRC = sglang_518_source()
pytestmark = needs_source(SRC)


class Pair:
    """The same pools and cache twice: kvscope's and SGLang 0.5.18's."""

    def __init__(self, sgl: object, page_size: int, window_len: int, full_size: int, swa_size: int) -> None:
        self.sgl, self.ps, self.window_len = sgl, page_size, window_len
        self.kv_alloc = SWATokenToKVPoolAllocator(full_size, swa_size, page_size, "cpu", strict=True)
        self.kv = SWARadixCache(self.kv_alloc, page_size, window_len=window_len, strict=True)
        self.sg_alloc = sgl.SWATokenToKVPoolAllocator(
            full_size, swa_size, page_size, torch.int64, "cpu", sgl.KVPool(), False
        )
        self.held: list[tuple[object, int | None, object, int | None]] = []
        self.sg = sgl.SWARadixCache(
            sgl.CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.sg_alloc,
                page_size=page_size,
                sliding_window_size=window_len,
            )
        )

    def key(self, tokens: np.ndarray) -> object:
        return self.sgl.RadixKey([int(t) for t in tokens])

    def same_pools(self, where: str) -> None:
        kv, sg = self.kv_alloc, self.sg_alloc
        assert kv.full_attn_allocator.free_pages.tolist() == sg.full_attn_allocator.free_pages.tolist(), where
        assert kv.swa_attn_allocator.free_pages.tolist() == sg.swa_attn_allocator.free_pages.tolist(), where
        assert torch.equal(kv.full_to_swa_index_mapping, sg.full_to_swa_index_mapping), where
        assert (self.kv.evictable_size(), self.kv.swa_evictable_size()) == (
            self.sg.full_evictable_size(),
            self.sg.swa_evictable_size(),
        ), where
        self.kv.check_integrity()

    def evict(self, full: int, swa: int, where: str) -> None:
        got = self.kv.evict(EvictParams(full, swa))
        want = self.sg.evict(self.sgl.EvictParams(num_tokens=full, swa_num_tokens=swa))
        assert got.swa_num_tokens_evicted == want.swa_num_tokens_evicted, where
        assert got.num_tokens_evicted >= want.num_tokens_evicted, where
        self.same_pools(where)

    def alloc(self, p: int, s: int, last: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return slots_alloc(self.kv_alloc, self.sg_alloc, self.ps, p, s, last)

    def serve(
        self, prompt: np.ndarray, all_ids: np.ndarray, slide: bool, grouped: bool, hold: bool, where: str
    ) -> None:
        ps = self.ps
        kv_hit = self.kv.match_prefix(prompt)
        sg_hit = self.sg.match_prefix(self.sgl.MatchPrefixParams(key=self.key(prompt)))
        assert kv_hit.device_indices.tolist() == sg_hit.device_indices.tolist(), where
        p, s = kv_hit.prefix_len, len(all_ids)
        kv_lock = self.kv.inc_lock_ref(kv_hit.last_node)
        sg_lock = self.sg.inc_lock_ref(sg_hit.last_device_node).swa_uuid_for_lock
        need = -(-s // ps) * ps - p
        full = min(max(need - self.kv_alloc.full_available_size(), 0), self.kv.evictable_size())
        swa = min(max(need - self.kv_alloc.swa_available_size(), 0), self.kv.swa_evictable_size())
        if full or swa:
            self.evict(full, swa, f"{where}: evict({full}, {swa})")
        last = int(kv_hit.device_indices[-1]) if p else -1
        mine, theirs = self.alloc(p, s, last)
        assert (mine is None) == (theirs is None), where
        if mine is not None and theirs is not None:
            assert mine.tolist() == theirs.tolist(), where
            self.insert(all_ids, torch.cat((kv_hit.device_indices, mine)), p, slide, grouped, where)
        self.held.append((kv_hit.last_node, kv_lock, sg_hit.last_device_node, sg_lock))
        if not hold:
            self.release(len(self.held) - 1)
        self.same_pools(where)

    def release(self, i: int) -> None:
        kv_node, kv_lock, sg_node, sg_lock = self.held.pop(i)
        self.kv.dec_lock_ref(kv_node, kv_lock)
        self.sg.dec_lock_ref(sg_node, self.sgl.DecLockRefParams(swa_uuid_for_lock=sg_lock))

    def insert(self, all_ids: np.ndarray, slots: torch.Tensor, p: int, slide: bool, grouped: bool, where: str) -> None:
        ps, s = self.ps, len(all_ids)
        key_len = s // ps * ps
        e = (s - max(self.window_len, ps)) // ps * ps if slide else 0
        if e > p:
            self.kv_alloc.free_swa(slots[p:e])
            self.sg_alloc.free_swa(slots[p:e].clone())
        evicted = max(e, p) if e > p else 0
        for alloc in (self.kv_alloc, self.sg_alloc):
            if grouped:
                alloc.free_group_begin()
        got = self.kv.insert(all_ids, slots, prev_prefix_len=p, swa_evicted_len=evicted)
        want = self.sg.insert(
            self.sgl.InsertParams(
                key=self.key(all_ids), value=slots[:key_len].clone(), prev_prefix_len=p, swa_evicted_seqlen=evicted
            )
        )
        assert got == want.prefix_len, where
        self.kv_alloc.free(slots[key_len:])
        self.sg_alloc.free(slots[key_len:].clone())
        for alloc in (self.kv_alloc, self.sg_alloc):
            if grouped:
                alloc.free_group_end()


@settings(max_examples=40, deadline=None)
@example(page_size=2, window_len=1, seed=33070, grouped=True)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    window_len=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    grouped=st.booleans(),
)
def test_swa_radix_cache_matches_sglang_0_5_18_slot_for_slot(
    page_size: int, window_len: int, seed: int, grouped: bool
) -> None:
    assert SRC is not None
    pair = Pair(load_sglang_518(SRC), page_size, window_len, 96 * page_size, 48 * page_size)
    rng = np.random.default_rng(seed)
    seen: list[np.ndarray] = []
    for i in range(60):
        all_ids = tokens(rng, seen)
        seen.append(all_ids)
        prompt = all_ids[: max(1, len(all_ids) - int(rng.integers(0, 8)))]
        pair.serve(
            prompt,
            all_ids,
            slide=bool(rng.random() < 0.5),
            grouped=grouped and bool(rng.random() < 0.5),
            hold=len(pair.held) < 3 and bool(rng.random() < 0.3),
            where=f"request {i}",
        )
        if pair.held and rng.random() < 0.3:
            pair.release(int(rng.integers(len(pair.held))))
        if rng.random() < 0.2 and pair.kv.swa_evictable_size():
            swa = int(rng.integers(1, pair.kv.swa_evictable_size() + 1))
            pair.evict(0, swa, f"after request {i}: SWA-only evict({swa})")
