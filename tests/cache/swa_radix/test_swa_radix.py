"""SWARadixCache (docs/memory-semantics.md §5): the window rule of match, tombstones from SWA
eviction, revival on insert, and a state machine with exact full and SWA accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvscope.cache import CacheMisuseError, EvictParams, EvictResult
from kvscope.cache.swa_radix import SWARadixCache
from kvscope.cache.tree import walk
from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, free_swa_out_of_window
from kvscope.telemetry import EventKind, ListRecorder
from tests.cache.helpers import Req, alloc_extend, ids


def make_cache(page_size: int = 1, window_len: int = 4, full_pages: int = 32, swa_pages: int = 24):
    ps = page_size
    allocator = SWATokenToKVPoolAllocator(full_pages * ps, swa_pages * ps, ps, "cpu", strict=True)
    rows = ReqToTokenPool(16, 64 * ps, "cpu", strict=True)
    cache = SWARadixCache(allocator, ps, window_len=window_len, req_to_token_pool=rows, strict=True)
    return cache, allocator


def insert_fresh(cache: SWARadixCache, tokens: np.ndarray, swa_evicted_len: int = 0) -> torch.Tensor:
    """Insert tokens with freshly allocated slots (none cached before)."""
    slots = alloc_extend(cache.allocator, 0, len(tokens), -1)
    assert slots is not None
    cache.insert(tokens, slots, swa_evicted_len=swa_evicted_len)
    return slots


def two_level_tree(window_len: int):
    """X = [1..8] (tombstoned by SWA eviction) with one live leaf Y = [9..12]."""
    cache, allocator = make_cache(window_len=window_len)
    insert_fresh(cache, ids(*range(1, 9)))
    insert_fresh(cache, ids(*range(1, 13)))
    assert cache.evict(EvictParams(0, swa_num_tokens=1)) == EvictResult(0, 8), "X's SWA half only"
    (x,) = cache.root.children.values()
    (y,) = x.children.values()
    assert x.tombstone and not y.tombstone
    return cache, allocator, x, y


def test_swa_eviction_tombstones_the_root_side_first_and_keeps_full_kv() -> None:
    cache, allocator, x, y = two_level_tree(window_len=4)
    mapping = allocator.full_to_swa_index_mapping
    assert (mapping[torch.from_numpy(x.value)] == 0).all()
    assert (mapping[torch.from_numpy(y.value)] > 0).all()
    assert (cache.evictable_size(), cache.swa_evictable_size()) == (12, 4)
    assert allocator.swa_available_size() == 24 - 4
    assert allocator.full_available_size() == 32 - 12
    cache.check_integrity()


def test_match_crosses_a_tombstone_only_with_a_window_of_live_tokens_after_it() -> None:
    cache, _, _, y = two_level_tree(window_len=4)
    hit = cache.match_prefix(ids(*range(1, 13)))
    assert (hit.prefix_len, hit.last_node) == (12, y)
    cut = cache.match_prefix(ids(*range(1, 11)))  # only 2 live tokens past the tombstone
    assert (cut.prefix_len, cut.last_node) == (0, cache.root)
    cache.check_integrity()


def test_match_stops_before_a_tombstone_when_the_window_is_not_covered() -> None:
    cache, _, _, _ = two_level_tree(window_len=5)
    assert cache.match_prefix(ids(*range(1, 13))).prefix_len == 0


def test_match_cut_lands_before_the_tombstone_after_a_live_window() -> None:
    cache, _ = make_cache(window_len=4)
    insert_fresh(cache, ids(*range(1, 5)))
    insert_fresh(cache, ids(*range(1, 9)))
    insert_fresh(cache, ids(*range(1, 11)))
    a = cache.root.children[ids(1).tobytes()]
    b = next(iter(a.children.values()))
    cache.inc_lock_ref(a)  # a stays live, b (older than its leaf) is tombstoned
    cache.evict(EvictParams(0, swa_num_tokens=1))
    assert b.tombstone and not a.tombstone
    hit = cache.match_prefix(ids(*range(1, 11)))
    assert (hit.prefix_len, hit.last_node) == (4, a)


def test_lock_inside_a_tombstone_window_is_refused() -> None:
    cache, _, x, _ = two_level_tree(window_len=4)
    with pytest.raises(CacheMisuseError, match="tombstone"):
        cache.inc_lock_ref(x)


def test_window_lock_id_sits_where_the_window_is_reached() -> None:
    cache, _ = make_cache(window_len=4)
    insert_fresh(cache, ids(*range(1, 9)))
    insert_fresh(cache, ids(*range(1, 11)))
    insert_fresh(cache, ids(*range(1, 13)))
    leaf = cache.match_prefix(ids(*range(1, 13))).last_node
    lock_id = cache.inc_lock_ref(leaf)
    mid = leaf.parent
    assert lock_id is not None and mid.swa_lock_id == lock_id
    assert (cache.swa_protected_size(), cache.protected_size()) == (4, 12)
    cache.match_prefix(ids(*range(1, 10)))  # split mid: the upper half takes the lock id
    assert mid.swa_lock_id is None and mid.parent.swa_lock_id == lock_id
    cache.dec_lock_ref(leaf, lock_id)
    assert (cache.swa_protected_size(), cache.protected_size()) == (0, 0)
    cache.check_integrity()


def test_evict_beyond_the_evictable_sizes_states_the_numbers() -> None:
    cache, _ = make_cache()
    insert_fresh(cache, ids(1, 2, 3))
    with pytest.raises(CacheMisuseError, match="swa 4"):
        cache.evict(EvictParams(0, swa_num_tokens=4))
    with pytest.raises(CacheMisuseError, match="evict\\(4"):
        cache.evict(EvictParams(4))


def test_window_rule_keeps_a_window_or_a_page_and_starts_at_the_trees_range() -> None:
    """Radix rule: threshold pre_len - max(window, page), never below cache_protected_len."""
    cache, _ = make_cache(page_size=4, window_len=3)
    req = Req("r1", np.arange(20, dtype=np.int32), cache_protected_len=8, swa_evicted_len=4)
    assert cache.window_range(req, 20) == (8, 16)
    assert cache.window_range(req, 10) == (8, 8)


def test_insert_revives_an_unlocked_tombstone_with_the_callers_slots() -> None:
    cache, allocator, x, _ = two_level_tree(window_len=4)
    old = x.value.copy()
    new = alloc_extend(allocator, 0, 12, -1)
    assert new is not None
    assert cache.insert(ids(*range(1, 9), 20, 21, 22, 23), new) == 8
    assert not x.tombstone and np.array_equal(x.value, new[:8].numpy())
    assert cache.swa_evictable_size() == 16
    owned = torch.from_numpy(cache.tree_slots())
    allocator.check_integrity(owned)
    assert not set(old.tolist()) & set(owned.tolist())
    cache.check_integrity()


def test_insert_revives_a_full_locked_tombstone_by_moving_the_swa_pairing() -> None:
    cache, allocator, x, y = two_level_tree(window_len=4)
    lock_id = cache.inc_lock_ref(y)
    kept = x.value.copy()
    new = alloc_extend(allocator, 0, 8, -1)
    assert new is not None
    swa_of_new = allocator.translate_loc(new).clone()
    cache.insert(ids(*range(1, 9)), new)
    assert not x.tombstone and np.array_equal(x.value, kept)
    assert torch.equal(allocator.translate_loc(torch.from_numpy(kept)), swa_of_new)
    allocator.check_integrity(torch.from_numpy(cache.tree_slots()))
    cache.check_integrity()
    cache.dec_lock_ref(y, lock_id)
    cache.check_integrity()


def test_insert_splits_a_tombstone_at_the_callers_swa_frontier() -> None:
    cache, allocator, x, _ = two_level_tree(window_len=4)
    new = alloc_extend(allocator, 0, 8, -1)
    assert new is not None
    allocator.free_swa(new[:4])
    cache.insert(ids(*range(1, 9)), new, swa_evicted_len=4)
    upper = cache.root.children[ids(1).tobytes()]
    assert upper.tombstone and len(upper.value) == 4
    assert x.parent is upper and not x.tombstone and len(x.value) == 4
    allocator.check_integrity(torch.from_numpy(cache.tree_slots()))
    cache.check_integrity()


def test_new_tail_below_the_frontier_becomes_a_tombstone_then_a_live_leaf() -> None:
    cache, allocator = make_cache(window_len=4)
    slots = alloc_extend(allocator, 0, 8, -1)
    assert slots is not None
    allocator.free_swa(slots[:5])
    cache.insert(ids(*range(1, 9)), slots, swa_evicted_len=5)
    (top,) = cache.root.children.values()
    (leaf,) = top.children.values()
    assert top.tombstone and (len(top.value), len(leaf.value)) == (5, 3)
    assert (cache.evictable_size(), cache.swa_evictable_size()) == (8, 3)
    cache.check_integrity()
    slots = alloc_extend(allocator, 0, 4, -1)
    assert slots is not None
    cache.insert(ids(7, 7, 7, 7), slots, swa_evicted_len=4)  # all out of the window: freed
    assert ids(7).tobytes() not in cache.root.children
    allocator.check_integrity(torch.from_numpy(cache.tree_slots()))


def test_insert_events_name_the_owner_of_each_new_node() -> None:
    cache, allocator = make_cache(window_len=4)
    recorder = ListRecorder()
    cache.recorder = recorder
    slots = alloc_extend(allocator, 0, 8, -1)
    assert slots is not None
    allocator.free_swa(slots[:5])
    cache.insert(ids(*range(1, 9)), slots, user="bob", swa_evicted_len=5)  # a tombstone, then a live leaf
    inserts = recorder.of_kind(EventKind.INSERT)
    assert [(e.num_tokens, e.principal) for e in inserts] == [(5, "bob"), (3, "bob")]


def test_events_record_tombstones_and_the_cascade_of_an_unlocked_leaf() -> None:
    cache, _, x, y = two_level_tree(window_len=4)
    recorder = ListRecorder()
    cache.recorder = recorder
    insert_fresh(cache, ids(50, 51, 52, 53))
    insert_fresh(cache, ids(50, 51, 52, 53, 54))
    freed = cache.evict(EvictParams(0, swa_num_tokens=1))  # y is the SWA-LRU node: an unlocked leaf, x follows it
    assert freed == EvictResult(12, 4), "y's both halves, then tombstone x's full KV"
    assert [(e.kind, e.node_id) for e in recorder.events[-2:]] == [(EventKind.EVICT, y.id), (EventKind.EVICT, x.id)]
    assert cache.evict(EvictParams(0, swa_num_tokens=1)) == EvictResult(0, 4)  # [50..53] is internal now: tombstoned
    last = recorder.events[-1]
    assert (last.kind, last.num_tokens) == (EventKind.TOMBSTONE, 4)
    cache.check_integrity()


# -- state machine -----------------------------------------------------------------------------------


class SWARadixMachine(RuleBasedStateMachine):
    page_size = 1
    window_len = 3
    holders = Bundle("holders")

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.cache, self.allocator = make_cache(ps, self.window_len, full_pages=20, swa_pages=7)
        self.rows = self.cache.req_to_token_pool
        assert self.rows is not None
        self.live: dict[str, Req] = {}
        self.num_reqs = 0

    def tokens(self) -> st.SearchStrategy[np.ndarray]:
        """A shared stem (deep trees, splits at many depths) and a short random tail."""
        ps = self.page_size
        stem = st.integers(0, 3 * ps + 3)
        tail = st.lists(st.integers(1, 2), max_size=ps + 2)
        return st.tuples(stem, tail).map(lambda t: np.array([*range(11, 11 + t[0]), *t[1]] or [1], np.int32))

    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        self.new_request(data)

    def new_request(self, data: st.DataObject) -> Req | None:
        tokens = data.draw(self.tokens(), "tokens")
        hit = self.cache.match_prefix(tokens)
        p = hit.prefix_len
        if p == len(tokens):
            return None
        lock_id = self.cache.inc_lock_ref(hit.last_node)
        slots = self.allocate(p, len(tokens), int(hit.device_indices[-1]) if p else -1)
        if slots is None:
            self.cache.dec_lock_ref(hit.last_node, lock_id)
            return None
        self.num_reqs += 1
        req = Req(
            f"r{self.num_reqs}",
            tokens,
            kv_committed_len=len(tokens),
            cache_protected_len=p,
            prefix_indices=hit.device_indices,
            last_node=hit.last_node,
            swa_lock_id=lock_id,
            swa_evicted_len=p,
        )
        assert self.rows is not None and self.rows.alloc([req]) is not None
        assert req.req_pool_idx is not None
        self.rows.write(req.req_pool_idx, 0, torch.cat((hit.device_indices, slots)))
        self.live[req.rid] = req
        return req

    @rule(data=st.data(), slide=st.booleans())
    def serve_request(self, data: st.DataObject, slide: bool) -> None:
        """A whole request at once: match, allocate, maybe slide its window, finish with insert."""
        req = self.new_request(data)
        if req is None:
            return
        if slide:
            self.slide(req)
        self.finish_req(req, True)

    def allocate(self, p: int, seq_len: int, last_loc: int) -> torch.Tensor | None:
        ps = self.page_size
        need = -(-(seq_len - p) // ps) * ps
        full_short = max(0, need - self.allocator.full_available_size())
        swa_short = max(0, need - self.allocator.swa_available_size())
        if full_short > self.cache.evictable_size() or swa_short > self.cache.swa_evictable_size():
            return None
        self.cache.evict(EvictParams(full_short, swa_short))
        return alloc_extend(self.allocator, p, seq_len, last_loc)

    def draw_req(self, data: st.DataObject) -> Req:
        return self.live[data.draw(st.sampled_from(sorted(self.live)), "rid")]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def slide_window(self, data: st.DataObject) -> None:
        self.slide(self.draw_req(data))

    def slide(self, req: Req) -> None:
        assert req.req_pool_idx is not None and self.rows is not None
        req.swa_evicted_len = free_swa_out_of_window(
            self.allocator,
            self.rows,
            req.req_pool_idx,
            req.swa_evicted_len,
            req.kv_committed_len,
            max(self.window_len, self.page_size),
        )

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunked=st.booleans())
    def cache_unfinished(self, data: st.DataObject, chunked: bool) -> None:
        req = self.draw_req(data)
        if req.swa_evicted_len > req.cache_protected_len:
            with pytest.raises(CacheMisuseError, match="frontier"):
                self.cache.cache_unfinished_req(req, chunked)
            return
        self.cache.cache_unfinished_req(req, chunked)
        assert req.cache_protected_len == len(req.fill_ids) // self.page_size * self.page_size

    @precondition(lambda self: self.live)
    @rule(data=st.data(), is_insert=st.booleans())
    def finish(self, data: st.DataObject, is_insert: bool) -> None:
        self.finish_req(self.draw_req(data), is_insert)

    def finish_req(self, req: Req, is_insert: bool) -> None:
        self.cache.cache_finished_req(req, is_insert)
        assert self.rows is not None
        self.rows.free(req)
        del self.live[req.rid]

    @rule(data=st.data())
    def match_only(self, data: st.DataObject) -> None:
        tokens = data.draw(self.tokens(), "tokens")
        hit = self.cache.match_prefix(tokens)
        assert hit.prefix_len % self.page_size == 0 and hit.prefix_len <= len(tokens)

    @rule(target=holders, data=st.data())
    def lock(self, data: st.DataObject) -> tuple[object, int | None]:
        hit = self.cache.match_prefix(data.draw(self.tokens(), "tokens"))
        return hit.last_node, self.cache.inc_lock_ref(hit.last_node)

    @rule(holder=consumes(holders))
    def unlock(self, holder: tuple[object, int | None]) -> None:
        self.cache.dec_lock_ref(*holder)

    @precondition(lambda self: self.cache.evictable_size() > 0)
    @rule(data=st.data())
    def evict_full(self, data: st.DataObject) -> None:
        before = self.cache.evictable_size()
        num_tokens = data.draw(st.integers(1, before), "num_tokens")
        swa_before = self.cache.swa_evictable_size()
        result = self.cache.evict(EvictParams(num_tokens))
        freed = result.num_tokens_evicted
        assert swa_before - self.cache.swa_evictable_size() == result.swa_num_tokens_evicted
        assert freed >= num_tokens and before - self.cache.evictable_size() == freed

    @precondition(lambda self: self.cache.swa_evictable_size() > 0)
    @rule(data=st.data())
    def evict_swa(self, data: st.DataObject) -> None:
        before, swa_before = self.cache.evictable_size(), self.cache.swa_evictable_size()
        swa_num_tokens = data.draw(st.integers(1, swa_before), "swa_num_tokens")
        result = self.cache.evict(EvictParams(0, swa_num_tokens))
        assert swa_before - self.cache.swa_evictable_size() == result.swa_num_tokens_evicted >= swa_num_tokens
        assert before - self.cache.evictable_size() == result.num_tokens_evicted

    @precondition(lambda self: self.cache.swa_evictable_size() < 1000)
    @rule()
    def evict_too_much(self) -> None:
        with pytest.raises(CacheMisuseError):
            self.cache.evict(EvictParams(0, self.cache.swa_evictable_size() + 1))

    @invariant()
    def integrity_and_accounting(self) -> None:
        cache, allocator = self.cache, self.allocator
        cache.check_integrity()
        nodes = [n for n, _, _ in walk(cache.root) if n is not cache.root]
        live_nodes = [n for n in nodes if not n.tombstone]
        assert cache.evictable_size() + cache.protected_size() == sum(len(n.value) for n in nodes)
        assert cache.swa_evictable_size() + cache.swa_protected_size() == sum(len(n.value) for n in live_nodes)
        request_full, request_swa = self.request_slots()
        owned = np.concatenate([cache.tree_slots(), request_full])
        allocator.check_integrity(torch.from_numpy(owned))
        mapping = allocator.full_to_swa_index_mapping[:-1]
        mapped = set(torch.nonzero(mapping > 0).flatten().tolist())
        expected = set(cache.live_tree_slots().tolist()) | set(request_swa.tolist())
        assert mapped == expected
        ps = self.page_size
        swa_pages = {int(s) // ps for s in mapping[sorted(mapped)].tolist()}
        assert allocator.swa_available_size() + ps * len(swa_pages) == allocator.swa_attn_allocator.total_size
        full_pages = set((owned // ps).tolist())
        assert allocator.full_available_size() + ps * len(full_pages) == allocator.full_attn_allocator.total_size
        for req in self.live.values():
            assert req.last_node is cache.root or req.last_node.lock_ref > 0

    def request_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Full slots each live request owns, and those of them still in its window."""
        full, swa = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        for req in self.live.values():
            assert self.rows is not None and req.req_pool_idx is not None
            row = self.rows.read(req.req_pool_idx, 0, req.kv_committed_len).numpy()
            full.append(row[req.cache_protected_len :])
            swa.append(row[max(req.cache_protected_len, req.swa_evicted_len) :])
        return np.concatenate(full), np.concatenate(swa)

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.finish_req(req, True)
        self.integrity_and_accounting()


class SWARadixMachinePaged(SWARadixMachine):
    page_size = 4
    window_len = 6


MACHINE_SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestSWARadixMachine = SWARadixMachine.TestCase
TestSWARadixMachine.settings = MACHINE_SETTINGS
TestSWARadixMachinePaged = SWARadixMachinePaged.TestCase
TestSWARadixMachinePaged.settings = MACHINE_SETTINGS


def test_a_full_locked_revive_frees_the_callers_full_pages_at_once_inside_a_free_group() -> None:
    """SGLang 0.5.18's free group sits in the SWA allocator, not in its pools: the revive's free
    on the full pool is not deferred (docs/memory-semantics.md §5.3; found by the differential
    test, tests/engines/test_swa_differential.py, page_size=2, seed=33070)."""
    cache, allocator, x, y = two_level_tree(window_len=4)
    lock_id = cache.inc_lock_ref(y)
    new = alloc_extend(allocator, 0, 8, -1)
    assert new is not None
    free_before = allocator.full_available_size()
    allocator.free_group_begin()
    cache.insert(ids(*range(1, 9)), new)
    assert not x.tombstone
    assert allocator.full_available_size() == free_before + 8
    assert set(new.tolist()) <= set(allocator.full_attn_allocator.free_pages.tolist())
    allocator.free_group_end()
    cache.dec_lock_ref(y, lock_id)
    allocator.check_integrity(torch.from_numpy(cache.tree_slots()))
    cache.check_integrity()
