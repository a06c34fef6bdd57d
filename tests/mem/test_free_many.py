"""free_many(chunks) leaves exactly the free lists that free_segments([(chunk, 0)]) for each
chunk would (SGLang's radix eviction frees each leaf with free_segment)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.mem import PoolMisuseError, make_token_allocator


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    need_sort=st.booleans(),
    in_group=st.booleans(),
    pages_per_chunk=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_free_many_equals_sequential_frees(
    page_size: int, need_sort: bool, in_group: bool, pages_per_chunk: list[int], seed: int
) -> None:
    twins = [make_token_allocator(32 * page_size, page_size, need_sort=need_sort, strict=True) for _ in range(2)]
    held = [a.alloc(sum(pages_per_chunk) * page_size) for a in twins]
    assert held[0] is not None and held[1] is not None and held[0].tolist() == held[1].tolist()
    pages = np.random.default_rng(seed).permutation(held[0].numpy().reshape(-1, page_size))
    chunks, start = [], 0
    for n in pages_per_chunk:
        chunks.append(pages[start : start + n].reshape(-1).copy())
        start += n
    for allocator in twins:
        if in_group:
            allocator.free_group_begin()
    for chunk in chunks:
        twins[0].free_segments([(torch.from_numpy(chunk), 0)])
    twins[1].free_many(chunks)
    for allocator in twins:
        if in_group:
            allocator.free_group_end()
        allocator.check_integrity([])
    assert twins[0].free_pages.tolist() == twins[1].free_pages.tolist()
    assert twins[0].release_pages.tolist() == twins[1].release_pages.tolist()


def test_free_many_in_strict_mode_rejects_partial_pages() -> None:
    allocator = make_token_allocator(16, 4, strict=True)
    got = allocator.alloc(8)
    assert got is not None
    with pytest.raises(PoolMisuseError, match="not whole aligned pages"):
        allocator.free_many([got.numpy()[1:5]])
