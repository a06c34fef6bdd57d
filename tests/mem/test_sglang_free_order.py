"""Free-list order where frees of different kinds meet, as in SGLang 0.5.18 and 0.5.23
(python/sglang/srt/mem_cache/allocator/paged.py and swa.py; docs/memory-semantics.md §2.4-2.6)."""

from __future__ import annotations

import torch

from kvscope.mem import SWATokenToKVPoolAllocator, make_token_allocator


def test_a_groups_segment_pages_go_in_front_of_its_sorted_free_pages() -> None:
    # SGLang: PagedTokenToKVPoolAllocator.free_group_end frees the group's free() slots (sorted,
    # unique pages), then releases the free_segment page ids, unsorted, in front of them.
    allocator = make_token_allocator(64, 2, strict=True)
    chunk, request_b, _kept = allocator.alloc(16), allocator.alloc(6), allocator.alloc(4)  # pages 1-8, 9-11, 12-13
    request_a = allocator.alloc_extend([0], [5], [-1], 5)  # pages 14-16
    assert chunk is not None and request_b is not None and request_a is not None
    allocator.free_group_begin()
    allocator.free_segments([(request_a, 0)])
    allocator.free(chunk)
    allocator.free(request_b)
    allocator.free_group_end()
    assert allocator.free_pages.tolist()[:14] == [14, 15, 16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    allocator.check_integrity(_kept)


def test_segments_outside_a_group_go_in_front_one_after_another() -> None:
    # SGLang: free_segments calls free_segment once per piece; each puts its pages in front.
    allocator = make_token_allocator(32, 2, strict=True)
    row = allocator.alloc_extend([0], [8], [-1], 8)  # pages 1-4
    assert row is not None
    allocator.free_segments([(row[:4], 0), (row[4:], 4)])
    assert allocator.free_pages.tolist()[:4] == [3, 4, 1, 2]
    allocator.check_integrity([])


def test_a_failed_swa_allocation_merges_no_release_list() -> None:
    # SGLang 0.5.18: SWATokenToKVPoolAllocator.alloc checks available_size() (free + released)
    # of both pools and returns None before either pool merges.
    allocator = SWATokenToKVPoolAllocator(8, 4, 1, need_sort=True, strict=True)
    held = allocator.alloc(4)
    assert held is not None
    allocator.free(held[2:])
    assert allocator.alloc(4) is None  # SWA: 0 free + 2 released
    assert allocator.swa_attn_allocator.release_pages.tolist() == [3, 4]
    assert allocator.full_attn_allocator.release_pages.tolist() == [3, 4]
    allocator.check_integrity(held[:2])


def test_swa_alloc_extend_merges_by_the_paged_extend_rule() -> None:
    # SGLang: PagedTokenToKVPoolAllocator.alloc_extend merges when
    # extend_num_tokens // page_size + batch size + 1 > free pages, before taking its pages.
    allocator = SWATokenToKVPoolAllocator(16, 16, 2, need_sort=True, strict=True)
    first = allocator.alloc_extend([0], [4], [-1], 4)  # pages 1-2
    assert first is not None
    allocator.free(first)
    slots = allocator.alloc_extend([0], [10], [-1], 10)  # 5 pages; 10 // 2 + 1 + 1 = 7 > 6 free
    assert slots is not None
    assert slots.tolist() == list(range(2, 12))
    assert allocator.translate_loc(slots).tolist() == list(range(2, 12))
    allocator.check_integrity(slots)


def test_a_swa_group_returns_each_pools_pages_once() -> None:
    allocator = SWATokenToKVPoolAllocator(32, 32, 2, strict=True)
    row = allocator.alloc_extend([0], [9], [-1], 9)
    assert row is not None
    allocator.free_group_begin()
    allocator.free_segments([(row[:4], 0), (row[4:], 4)])
    allocator.free_group_end()
    assert allocator.full_available_size() == allocator.swa_available_size() == 32
    allocator.check_integrity(torch.empty(0, dtype=torch.int64))
