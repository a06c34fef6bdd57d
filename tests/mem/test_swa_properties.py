"""Hypothesis state machine: the SWA allocator (full + window pools joined by the mapping)
and window freeing through a real ReqToTokenPool, against the reference model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, free_swa_out_of_window
from tests.mem.reference import RefFreeList, cdiv, ref_extend

FULL_PAGES, SWA_PAGES, WINDOW = 24, 14, 5


@dataclass
class Req:
    slots: list[int] = field(default_factory=list)
    frontier: int = 0
    req_pool_idx: int | None = None


class SWAMachine(RuleBasedStateMachine):
    page_size = 1
    device = "cpu"

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = SWATokenToKVPoolAllocator(FULL_PAGES * ps, SWA_PAGES * ps, ps, self.device, strict=True)
        self.rows = ReqToTokenPool(12, 256, self.device, strict=True)
        self.full = RefFreeList(FULL_PAGES, ps, False)
        self.swa = RefFreeList(SWA_PAGES, ps, False)
        self.mapping: dict[int, int] = {}
        self.requests: dict[int, Req] = {}
        self.next_rid = 0

    def tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.alloc.device)

    @precondition(lambda self: len(self.requests) < 8)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        ps = self.page_size
        rid = data.draw(st.sampled_from([*sorted(self.requests), -1]), "rid")
        req = self.requests.get(rid, Req())
        p = len(req.slots)
        s = p + data.draw(st.integers(1, 2 * ps + 3), "extend_len")
        pages_needed = s - p if ps == 1 else cdiv(s, ps) - cdiv(p, ps)
        enough = pages_needed <= len(self.full.free) and pages_needed <= len(self.swa.free)
        last = req.slots[-1] if p else -1
        got = self.alloc.alloc(s - p) if ps == 1 else self.alloc.alloc_extend([p], [s], [last], s - p)
        if not enough:
            assert got is None
            return
        full_pages, swa_pages = self.full.take(pages_needed), self.swa.take(pages_needed)
        assert full_pages is not None and swa_pages is not None
        if ps == 1:
            expected_full, expected_swa = full_pages, swa_pages
        else:
            expected_full = ref_extend(self.full, [p], [s], [last], full_pages)
            swa_last = self.mapping.get(last, 0) if last >= 0 else -1
            expected_swa = ref_extend(self.swa, [p], [s], [swa_last], swa_pages)
        assert got is not None and got.tolist() == expected_full
        assert self.alloc.translate_loc(got).tolist() == expected_swa
        self.mapping.update(zip(expected_full, expected_swa, strict=True))
        if rid == -1:
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            assert self.rows.alloc([req]) is not None
        self.requests[rid] = req
        assert req.req_pool_idx is not None
        self.rows.write(req.req_pool_idx, p, got)
        req.slots.extend(expected_full)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), for_radix=st.booleans(), lag=st.integers(0, 1))
    def window_moves(self, data: st.DataObject, for_radix: bool, lag: int) -> None:
        ps = self.page_size
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)), "rid")]
        pre_len = len(req.slots) - lag
        keep_len = max(WINDOW, ps) if for_radix else WINDOW  # the radix and the chunk caches' rules
        threshold = pre_len - keep_len
        expected = max(req.frontier, max(req.frontier, threshold) // ps * ps)
        assert req.req_pool_idx is not None
        new = free_swa_out_of_window(self.alloc, self.rows, req.req_pool_idx, req.frontier, pre_len, keep_len)
        assert new == expected
        self.model_free_swa(req.slots[req.frontier : new])
        req.frontier = new

    def model_free_swa(self, full_slots: list[int]) -> None:
        ps = self.page_size
        if ps > 1:
            full_slots = self.full.expand(sorted({s // ps for s in full_slots}))
        live = [s for s in full_slots if self.mapping.get(s, 0) > 0]
        self.swa.release_slots([self.mapping.pop(s) for s in live])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)), "rid")
        req = self.requests.pop(rid)
        self.alloc.free(self.tensor(req.slots))
        self.swa.release_slots([self.mapping.pop(s) for s in req.slots if self.mapping.get(s, 0) > 0])
        self.full.release_slots(req.slots)
        self.rows.free(req)

    @precondition(lambda self: self.full.group is None)
    @rule()
    def group_begin(self) -> None:
        self.alloc.free_group_begin()
        self.full.group, self.swa.group = [], []

    @precondition(lambda self: self.full.group is not None)
    @rule()
    def group_end(self) -> None:
        self.alloc.free_group_end()
        self.full.group_end()
        self.swa.group_end()

    @invariant()
    def conserved(self) -> None:
        owned = [s for r in self.requests.values() for s in r.slots]
        self.alloc.check_integrity(owned)
        self.rows.check_integrity([r.req_pool_idx for r in self.requests.values() if r.req_pool_idx])
        assert self.alloc.full_available_size() == self.full.available()
        assert self.alloc.swa_available_size() == self.swa.available()
        assert self.alloc.full_attn_allocator.free_pages.tolist() == self.full.free
        assert self.alloc.swa_attn_allocator.free_pages.tolist() == self.swa.free

    @invariant()
    def mapping_matches(self) -> None:
        ps = self.page_size
        mapping = self.alloc.full_to_swa_index_mapping
        for req in self.requests.values():
            got = mapping[self.tensor(req.slots)].tolist() if req.slots else []
            assert got == [self.mapping.get(s, 0) for s in req.slots]
            assert all(v == 0 for v in got[: req.frontier]), "window-freed positions still mapped"
            assert all(v % ps == s % ps for s, v in zip(req.slots, got, strict=True) if v)


for _ps in (1, 4, 8):
    for _device in ("cpu", "cuda"):
        _cls = type(f"SWA_ps{_ps}_{_device}", (SWAMachine,), {"page_size": _ps, "device": _device})
        _case = _cls.TestCase
        _case.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
        if _device == "cuda":
            _case.pytestmark = [pytest.mark.cuda]
        globals()[f"Test{_cls.__name__}"] = _case
del _case
