"""Strict mode reports each misuse where it happens, naming the pool and the slots; with
strict off the same misuse goes through and check_integrity() finds it afterwards."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvscope.mem import (
    IntegrityError,
    PagedTokenToKVPoolAllocator,
    PoolMisuseError,
    ReqToTokenPool,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from tests.conftest import device_params


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("device", device_params())
def test_double_free_names_pool_and_slots(device: str) -> None:
    alloc = TokenToKVPoolAllocator(16, device, strict=True)
    got = alloc.alloc(3)
    assert got is not None
    alloc.free(got)
    with pytest.raises(PoolMisuseError, match=r"\[full\] double free.*slots \[1, 2, 3\]"):
        alloc.free(got)
    alloc.check_integrity([])


def test_double_free_within_one_call() -> None:
    alloc = TokenToKVPoolAllocator(16, strict=True)
    alloc.alloc(3)
    with pytest.raises(PoolMisuseError, match=r"double free within one call.*\[2\]"):
        alloc.free(slots(2, 2))


def test_padding_slot_is_rejected() -> None:
    alloc = PagedTokenToKVPoolAllocator(32, 4, strict=True)
    with pytest.raises(PoolMisuseError, match=r"padding slot.*\[3\]"):
        alloc.free(slots(3))


def test_never_allocated_slot_is_rejected() -> None:
    alloc = TokenToKVPoolAllocator(16, strict=True, name="swa")
    with pytest.raises(PoolMisuseError, match=r"\[swa\] freeing slots that were never allocated.*\[7\]"):
        alloc.free(slots(7))


def test_out_of_range_slot_is_rejected() -> None:
    alloc = TokenToKVPoolAllocator(16, strict=True)
    with pytest.raises(PoolMisuseError, match=r"outside the pool.*\[99\]"):
        alloc.free(slots(99))


def test_misaligned_paged_allocations_are_rejected() -> None:
    alloc = PagedTokenToKVPoolAllocator(64, 4, strict=True)
    with pytest.raises(PoolMisuseError, match="page-misaligned alloc of 6 tokens"):
        alloc.alloc(6)
    first = alloc.alloc_extend([0], [6], [-1], 6)
    assert first is not None
    with pytest.raises(PoolMisuseError, match=r"page-misaligned extend.*\[" + str(int(first[4])) + r"\]"):
        alloc.alloc_extend([6], [9], [int(first[4])], 3)
    with pytest.raises(PoolMisuseError, match="page-misaligned decode"):
        alloc.alloc_decode([7], [int(first[4])])
    with pytest.raises(PoolMisuseError, match="extend_num_tokens 5"):
        alloc.alloc_extend([6], [9], [int(first[5])], 5)


def test_continuing_a_freed_page_is_rejected() -> None:
    alloc = PagedTokenToKVPoolAllocator(64, 4, strict=True)
    first = alloc.alloc_extend([0], [6], [-1], 6)
    assert first is not None
    alloc.free(first)
    with pytest.raises(PoolMisuseError, match="continues a page that is not allocated"):
        alloc.alloc_decode([7], [int(first[5])])


def test_swa_double_free_is_caught_in_the_full_pool() -> None:
    alloc = SWATokenToKVPoolAllocator(16, 8, 1, strict=True)
    got = alloc.alloc(2)
    assert got is not None
    alloc.free(got)
    with pytest.raises(PoolMisuseError, match=r"\[full\] double free"):
        alloc.free(got)


def test_free_swa_twice_is_harmless() -> None:
    alloc = SWATokenToKVPoolAllocator(16, 8, 1, strict=True)
    got = alloc.alloc(4)
    assert got is not None
    alloc.free_swa(got[:2])
    alloc.free_swa(got[:2])
    assert alloc.swa_available_size() == 6
    alloc.check_integrity(got)


@dataclass
class Holder:
    req_pool_idx: int | None = None


def test_req_pool_double_free_and_padding_row() -> None:
    pool = ReqToTokenPool(4, 8, strict=True)
    holder = Holder()
    assert pool.alloc([holder]) == [4]
    row = holder.req_pool_idx
    pool.free(holder)
    holder.req_pool_idx = row
    with pytest.raises(PoolMisuseError, match=r"\[req\] double free of a row.*\[4\]"):
        pool.free(holder)
    with pytest.raises(PoolMisuseError, match="padding row"):
        pool.free(Holder(0))
    with pytest.raises(PoolMisuseError, match="holds no row"):
        pool.free(Holder())


def test_free_groups_do_not_nest() -> None:
    alloc = TokenToKVPoolAllocator(8)
    alloc.free_group_begin()
    with pytest.raises(PoolMisuseError, match="inside an open free group"):
        alloc.free_group_begin()
    alloc.free_group_end()
    with pytest.raises(PoolMisuseError, match="without free_group_begin"):
        alloc.free_group_end()


def test_without_strict_a_double_free_is_found_by_check_integrity() -> None:
    alloc = TokenToKVPoolAllocator(16)
    got = alloc.alloc(2)
    assert got is not None
    alloc.free(got)
    alloc.free(got)
    with pytest.raises(IntegrityError, match=r"pages free twice: \[1, 2\]"):
        alloc.check_integrity()


def test_check_integrity_names_leaked_pages() -> None:
    alloc = PagedTokenToKVPoolAllocator(32, 4)
    kept = alloc.alloc(8)
    leaked = alloc.alloc(4)
    assert kept is not None and leaked is not None
    with pytest.raises(IntegrityError, match=r"leaked pages \[3\]"):
        alloc.check_integrity(kept)


def test_strict_turned_on_mid_run_tracks_from_then() -> None:
    alloc = TokenToKVPoolAllocator(8)
    got = alloc.alloc(3)
    assert got is not None
    alloc.set_strict(True)
    alloc.check_integrity(got)
    alloc.free(got[:1])
    with pytest.raises(PoolMisuseError, match="double free"):
        alloc.free(got[:1])


def test_group_defers_available_size_until_end() -> None:
    alloc = PagedTokenToKVPoolAllocator(32, 4, strict=True)
    got = alloc.alloc(12)
    assert got is not None
    alloc.free_group_begin()
    alloc.free(got[:4])
    alloc.free(got[4:])
    assert alloc.available_size() == 20
    alloc.check_integrity([])
    alloc.free_group_end()
    assert alloc.available_size() == 32
    assert alloc.free_pages[:3].tolist() == [1, 2, 3]


def test_need_sort_merges_release_on_demand() -> None:
    alloc = TokenToKVPoolAllocator(8, need_sort=True)
    got = alloc.alloc(6)
    assert got is not None
    alloc.free(slots(5, 2, 4))
    assert alloc.free_pages.tolist() == [7, 8]
    assert alloc.release_pages.tolist() == [5, 2, 4]
    assert alloc.alloc(2).tolist() == [7, 8]  # type: ignore[union-attr]
    assert alloc.alloc(2).tolist() == [2, 4]  # type: ignore[union-attr]


def test_paged_check_integrity_rejects_a_slot_owned_twice() -> None:
    alloc = PagedTokenToKVPoolAllocator(8, 4)
    got = alloc.alloc(4)
    assert got is not None
    with pytest.raises(IntegrityError, match="slots owned twice"):
        alloc.check_integrity(torch.cat((got, got)))


def test_restoring_a_snapshot_taken_before_strict_keeps_strict_working() -> None:
    alloc = TokenToKVPoolAllocator(8)
    snapshot = alloc.backup_state()
    alloc.set_strict(True)
    alloc.alloc(3)
    alloc.restore_state(snapshot)
    got = alloc.alloc(2)
    assert got is not None and got.tolist() == [1, 2]
    alloc.check_integrity(got)
