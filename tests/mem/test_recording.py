"""Allocators record every allocation and free, with the pool, the slots and the request."""

from __future__ import annotations

import torch

from kvscope.mem import SWATokenToKVPoolAllocator, charged_to, make_token_allocator
from kvscope.telemetry import EventKind, ListRecorder, PoolName


def test_plain_and_paged_allocators_record_allocs_and_frees() -> None:
    for page_size in (1, 4):
        recorder = ListRecorder()
        allocator = make_token_allocator(64, page_size)
        allocator.recorder = recorder
        with charged_to(allocator, "r1"):
            first = allocator.alloc(8)
            assert first is not None
            if page_size > 1:
                more = allocator.alloc_extend([8], [10], [int(first[-1])], 2)  # type: ignore[attr-defined]
                step = allocator.alloc_decode([11], [int(more[-1])])  # type: ignore[attr-defined]
                assert more is not None and step is not None
                allocator.free_segments([(torch.cat((first, more, step)), 0)])
            else:
                allocator.free(first)
        allocator.free_many([])
        kinds = [(e.kind, e.pool, e.rid) for e in recorder.events]
        allocs = [e for e in recorder.events if e.kind is EventKind.ALLOC]
        frees = [e for e in recorder.events if e.kind is EventKind.FREE]
        assert all(k[1] is PoolName.FULL and k[2] == "r1" for k in kinds)
        assert sorted(s for e in allocs for s in e.slots) == sorted(s for e in frees for s in e.slots)
        assert allocs[0].slots == first.tolist() and allocs[0].num_tokens == 8


def test_swa_allocator_records_both_halves() -> None:
    recorder = ListRecorder()
    allocator = SWATokenToKVPoolAllocator(32, 16, 1)
    allocator.recorder = recorder
    with charged_to(allocator, "r7"):
        full = allocator.alloc(4)
        assert full is not None
        swa = allocator.translate_loc(full).tolist()
        allocator.free_swa(full[:2])
        allocator.free(full)
    seen = [(e.kind, e.pool, e.slots) for e in recorder.events]
    assert seen == [
        (EventKind.ALLOC, PoolName.FULL, full.tolist()),
        (EventKind.ALLOC, PoolName.SWA, swa),
        (EventKind.FREE, PoolName.SWA, swa[:2]),
        (EventKind.FREE, PoolName.SWA, swa[2:]),
        (EventKind.FREE, PoolName.FULL, full.tolist()),
    ]
    assert {e.rid for e in recorder.events} == {"r7"}
