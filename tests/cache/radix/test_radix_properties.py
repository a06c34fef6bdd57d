"""Hypothesis state machine over RadixCache: requests that prefill (in chunks), decode,
finish or retract, plus bare matches, locks and evictions.

After every step: cache.check_integrity() (sizes equal node sums, no slot in two nodes,
no tree slot free in the allocator), allocator conservation (free + tree + request-owned
== every page), locked nodes still in the tree, and every matched slot holds the KV of
exactly the token and position it was matched for.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.cache import EvictParams, RadixCache
from kvscope.mem import ReqToTokenPool, make_token_allocator
from tests.cache.helpers import Req, alloc_extend

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    granularity = "leaf"
    device = "cpu"

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.allocator = make_token_allocator(48 * ps, ps, self.device, strict=True)
        self.rows = ReqToTokenPool(6, 256, self.device, strict=True)
        self.cache = RadixCache(
            self.allocator, ps, req_to_token_pool=self.rows, strict=True, eviction_granularity=self.granularity
        )  # type: ignore[arg-type]
        self.running: list[Req] = []
        self.held_locks: list[object] = []
        self.kv = np.full((self.allocator.total_size + ps, 2), -1, dtype=np.int64)
        self.next_rid = 0

    # -- helpers ---------------------------------------------------------------------------

    def check_match(self, ids: np.ndarray, slots: torch.Tensor) -> None:
        got = self.kv[slots.cpu().numpy()]
        assert (got[:, 0] == ids[: len(got)]).all() and (got[:, 1] == np.arange(len(got))).all()

    def grow(self, req: Req, new_ids: list[int]) -> bool:
        """Give positions [kv_len, kv_len + len(new_ids)) slots, evicting the shortfall."""
        start, end = req.kv_committed_len, req.kv_committed_len + len(new_ids)
        need = end - start + self.page_size
        shortfall = need - self.allocator.available_size()
        if shortfall > 0:
            self.cache.evict(EvictParams(min(shortfall, self.cache.evictable_size())))
        assert req.req_pool_idx is not None
        last = int(self.rows.read(req.req_pool_idx, start - 1, start)[0]) if start else -1
        slots = alloc_extend(self.allocator, start, end, last)
        if slots is None:
            return False
        self.rows.write(req.req_pool_idx, start, slots)
        self.kv[slots.cpu().numpy()] = np.stack([np.array(new_ids), np.arange(start, end)], axis=1)
        req.fill_ids = np.concatenate((req.fill_ids[:start], np.array(new_ids, dtype=np.int32)))
        req.kv_committed_len = end
        return True

    def release(self, req: Req, is_insert: bool) -> None:
        self.cache.cache_finished_req(req, is_insert=is_insert)
        self.rows.free(req)
        self.running.remove(req)

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.running) < 5)
    @rule(prompt=TOKENS, chunk=st.integers(1, 24))
    def admit(self, prompt: list[int], chunk: int) -> None:
        ids = np.array(prompt, dtype=np.int32)
        match = self.cache.match_prefix(ids[: len(ids) - 1])
        self.check_match(ids, match.device_indices)
        self.cache.inc_lock_ref(match.last_node)
        req = Req(
            f"r{self.next_rid}",
            ids[: match.prefix_len],
            last_node=match.last_node,
            cache_protected_len=match.prefix_len,
            kv_committed_len=match.prefix_len,
        )
        self.next_rid += 1
        assert self.rows.alloc([req]) is not None
        assert req.req_pool_idx is not None
        self.rows.write(req.req_pool_idx, 0, match.device_indices)
        end = min(len(ids), match.prefix_len + chunk)
        if not self.grow(req, prompt[match.prefix_len : end]):
            self.cache.dec_lock_ref(match.last_node)
            self.allocator.free(match.device_indices[:0])
            self.rows.free(req)
            return
        self.running.append(req)
        self.cache.cache_unfinished_req(req, chunked=end < len(ids))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), more=TOKENS, chunked=st.booleans())
    def extend(self, data: st.DataObject, more: list[int], chunked: bool) -> None:
        req = data.draw(st.sampled_from(self.running))
        if self.grow(req, more):
            self.cache.cache_unfinished_req(req, chunked=chunked)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.grow(req, [token])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), last_token=st.integers(0, 2), is_insert=st.booleans())
    def finish(self, data: st.DataObject, last_token: int, is_insert: bool) -> None:
        req = data.draw(st.sampled_from(self.running))
        req.fill_ids = np.append(req.fill_ids, np.int32(last_token))  # the last token has no KV
        self.release(req, is_insert)

    @rule(query=TOKENS, lock=st.booleans())
    def match(self, query: list[int], lock: bool) -> None:
        ids = np.array(query, dtype=np.int32)
        got = self.cache.match_prefix(ids)
        assert got.prefix_len % self.page_size == 0
        self.check_match(ids, got.device_indices)
        if lock:
            self.cache.inc_lock_ref(got.last_node)
            self.held_locks.append(got.last_node)

    @precondition(lambda self: self.held_locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node = self.held_locks.pop(data.draw(st.integers(0, len(self.held_locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(fraction=st.floats(0, 1))
    def evict(self, fraction: float) -> None:
        want = int(self.cache.evictable_size() * fraction)
        got = self.cache.evict(EvictParams(want))
        assert got.num_tokens_evicted >= want and got.swa_num_tokens_evicted == 0

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()
        owned = [self.cache.tree_slots()]
        for req in self.running:
            assert req.req_pool_idx is not None
            owned.append(self.rows.read(req.req_pool_idx, req.cache_protected_len, req.kv_committed_len).numpy())
        self.allocator.check_integrity(np.concatenate(owned))
        self.rows.check_integrity([r.req_pool_idx for r in self.running if r.req_pool_idx])

    @invariant()
    def locked_nodes_stay(self) -> None:
        for node in [*self.held_locks, *(r.last_node for r in self.running)]:
            assert node is self.cache.root or node.parent is not None, "a locked node was evicted"


for _ps, _gran in ((1, "leaf"), (4, "leaf"), (16, "leaf"), (1, "page"), (4, "page")):
    for _device in ("cpu", "cuda"):
        _cls = type(
            f"Radix_ps{_ps}_{_gran}_{_device}",
            (RadixMachine,),
            {"page_size": _ps, "granularity": _gran, "device": _device},
        )
        _case = _cls.TestCase
        _case.settings = settings(max_examples=30, stateful_step_count=35, deadline=None)
        if _device == "cuda":
            _case.pytestmark = [pytest.mark.cuda]
        globals()[f"Test{_cls.__name__}"] = _case
del _case
