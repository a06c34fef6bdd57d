"""Hypothesis state machines: page-size-1 and paged allocators against the reference model.

Every step compares the returned slots exactly with the model, then calls
check_integrity() with every slot the requests own and asserts the alignment invariant.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.mem import make_token_allocator
from tests.mem.reference import RefFreeList, cdiv, ref_extend

NUM_PAGES = 24
MAX_REQUESTS = 10


class AllocatorMachine(RuleBasedStateMachine):
    page_size = 1
    need_sort = False
    strict = False
    device = "cpu"

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = make_token_allocator(NUM_PAGES * ps, ps, self.device, need_sort=self.need_sort, strict=self.strict)
        self.model = RefFreeList(NUM_PAGES, ps, self.need_sort)
        self.requests: dict[int, list[int]] = {}
        self.next_rid = 0

    def tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.alloc.device)

    # -- allocation ------------------------------------------------------------------------

    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        num_new = data.draw(st.integers(0 if self.requests else 1, 3), "num_new")
        num_new = min(num_new, MAX_REQUESTS - len(self.requests))
        existing = data.draw(
            st.lists(st.sampled_from(sorted(self.requests)), unique=True, max_size=2) if self.requests else st.just([]),
            "existing",
        )
        if num_new == 0 and not existing:
            return
        rids = existing + list(range(self.next_rid, self.next_rid + num_new))
        prefix = [len(self.requests.get(r, [])) for r in rids]
        seq = [p + data.draw(st.integers(1, 3 * self.page_size + 2), "extend_len") for p in prefix]
        last = [self.requests[r][-1] if p else -1 for r, p in zip(rids, prefix, strict=True)]
        total = sum(s - p for p, s in zip(prefix, seq, strict=True))
        expected = self.model_extend(prefix, seq, last, total)
        if self.page_size == 1:
            got = self.alloc.alloc(total)
        else:
            got = self.alloc.alloc_extend(prefix, seq, last, total)  # type: ignore[attr-defined]
        if expected is None:
            assert got is None
            return
        assert got is not None and got.tolist() == expected
        self.next_rid += num_new
        cursor = 0
        for r, p, s in zip(rids, prefix, seq, strict=True):
            self.requests.setdefault(r, []).extend(expected[cursor : cursor + s - p])
            cursor += s - p

    def model_extend(self, prefix: list[int], seq: list[int], last: list[int], total: int) -> list[int] | None:
        ps, m = self.page_size, self.model
        if ps == 1:
            pages = m.take(total)
            return pages
        if m.need_sort and total // ps + len(seq) + 1 > len(m.free):
            m.merge()
        pages = m.take(sum(cdiv(s, ps) - cdiv(p, ps) for p, s in zip(prefix, seq, strict=True)))
        return None if pages is None else ref_extend(m, prefix, seq, last, pages)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.requests)), unique=True, min_size=1), "batch")
        ps, m = self.page_size, self.model
        seq = [len(self.requests[r]) + 1 for r in rids]
        if ps == 1:
            expected = m.take(len(rids))
            got = self.alloc.alloc(len(rids))
        else:
            if m.need_sort and len(rids) > len(m.free):
                m.merge()
            pages = m.take(sum(1 for s in seq if s % ps == 1))
            expected = None
            if pages is not None:
                fresh = iter(pages)
                expected = [
                    next(fresh) * ps if s % ps == 1 else self.requests[r][-1] + 1
                    for r, s in zip(rids, seq, strict=True)
                ]
            last = [self.requests[r][-1] for r in rids]
            got = self.alloc.alloc_decode(seq, last)  # type: ignore[attr-defined]
        if expected is None:
            assert got is None
            return
        assert got is not None and got.tolist() == expected
        for r, slot in zip(rids, expected, strict=True):
            self.requests[r].append(slot)

    # -- freeing -----------------------------------------------------------------------------

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)), "rid")
        slots = self.requests.pop(rid)
        ps = self.page_size
        split = data.draw(st.integers(0, len(slots) // ps), "split_page") * ps
        if ps > 1 and 0 < split < len(slots):
            self.alloc.free_segment(self.tensor(slots[:split]), 0)  # type: ignore[attr-defined]
            self.alloc.free_segment(self.tensor(slots[split:]), split)  # type: ignore[attr-defined]
            self.model.release_segment_pages(slots[:split])
            self.model.release_segment_pages(slots[split:])
        else:
            self.alloc.free(self.tensor(slots))
            self.model.release_slots(slots)

    @precondition(lambda self: self.model.group is None)
    @rule()
    def group_begin(self) -> None:
        self.alloc.free_group_begin()
        self.model.group = []

    @precondition(lambda self: self.model.group is not None)
    @rule()
    def group_end(self) -> None:
        self.alloc.free_group_end()
        self.model.group_end()

    @precondition(lambda self: self.model.group is None)
    @rule(num_pages=st.integers(1, 6))
    def alloc_then_rollback(self, num_pages: int) -> None:
        before = (self.alloc.free_pages.tolist(), self.alloc.release_pages.tolist())
        state = self.alloc.backup_state()
        self.alloc.alloc(num_pages * self.page_size)
        self.alloc.restore_state(state)
        assert (self.alloc.free_pages.tolist(), self.alloc.release_pages.tolist()) == before

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def conserved(self) -> None:
        owned = [s for slots in self.requests.values() for s in slots]
        self.alloc.check_integrity(owned)
        assert self.alloc.available_size() == self.model.available()
        assert self.alloc.free_pages.tolist() == self.model.free
        assert self.alloc.release_pages.tolist() == self.model.release

    @invariant()
    def aligned_and_exclusive(self) -> None:
        ps = self.page_size
        owner: dict[int, int] = {}
        for rid, slots in self.requests.items():
            for pos, slot in enumerate(slots):
                assert slot % ps == pos % ps, f"request {rid} position {pos} at slot {slot}"
                assert slot >= ps, f"padding slot {slot} handed out"
                assert owner.setdefault(slot // ps, rid) == rid, f"page {slot // ps} in two requests"


CASES = [
    (1, False, False),
    (1, True, True),
    (4, False, True),
    (4, True, False),
    (16, False, False),
    (16, True, True),
]


def _machine(page_size: int, need_sort: bool, strict: bool, device: str) -> type[AllocatorMachine]:
    attrs = {"page_size": page_size, "need_sort": need_sort, "strict": strict, "device": device}
    return type(f"Alloc_ps{page_size}_sort{need_sort}_strict{strict}_{device}", (AllocatorMachine,), attrs)


for _ps, _sort, _strict in CASES:
    for _device in ("cpu", "cuda"):
        _case = _machine(_ps, _sort, _strict, _device).TestCase
        _case.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
        if _device == "cuda":
            _case.pytestmark = [pytest.mark.cuda]
        globals()[f"Test{_case.__qualname__.split('.')[0]}"] = _case
del _case
