"""The host tier's sizing, allocator and buffers (docs/memory-semantics.md §2.8).

The allocator's state machine compares every returned slot exactly with a reference model:
a free list and a release list of Python ints plus the set of free slots. The rule is
simple enough to model exactly (take the head of the free list; append the release list
only when the free list alone is too short; frees append to the release list), so the
model checks the order SGLang hands slots out in, not only that they are distinct, in
range, free before and as many as asked.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.mem import HostKVPool, HostTokenAllocator, IntegrityError, PoolMisuseError, host_pool_tokens

# -- sizing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_tokens", "page_size", "ratio", "tokens", "expected"),
    [
        (100, 1, 2.0, None, 201),  # 200 tokens, plus SGLang's extra page
        (100, 4, 2.0, None, 204),  # 200 is aligned: 50 pages + 1
        (100, 16, 2.0, None, 208),  # 200 // 16 = 12 pages + 1
        (100, 4, 0.5, None, 52),  # 50 // 4 = 12 pages + 1
        (7, 4, 0.1, None, 4),  # int(0.7) = 0 tokens: the extra page alone
        (100, 16, 2.0, 64, 80),  # tokens win over the ratio: 4 pages + 1
        (100, 16, None, 70, 80),  # 70 // 16 = 4 pages + 1
        (100, 1, None, 1, 2),
    ],
)
def test_host_pool_tokens_adds_a_page_to_the_whole_pages(
    device_tokens: int, page_size: int, ratio: float | None, tokens: int | None, expected: int
) -> None:
    got = host_pool_tokens(device_tokens, page_size, ratio=ratio, tokens=tokens)
    assert got == expected
    assert got % page_size == 0


@pytest.mark.parametrize(
    ("ratio", "tokens", "match"),
    [
        (0.0, None, "ratio must be a finite number > 0, got 0.0"),
        (-1.0, None, "ratio must be a finite number > 0, got -1.0"),
        (math.nan, None, "ratio must be a finite number > 0, got nan"),
        (math.inf, None, "ratio must be a finite number > 0, got inf"),
        (2.0, 3, r"tokens must be a finite number >= page_size \(4\), got 3"),
        (2.0, math.inf, r"tokens must be a finite number >= page_size \(4\), got inf"),
        (None, None, "give a ratio of the device pool or a number of tokens"),
    ],
)
def test_host_pool_tokens_rejects_bad_sizes_in_one_line(ratio: float | None, tokens: float | None, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        host_pool_tokens(100, 4, ratio=ratio, tokens=tokens)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


# -- allocator state machine --------------------------------------------------------------


class HostAllocatorMachine(RuleBasedStateMachine):
    page_size = 1
    strict = False
    num_pages = 12

    def __init__(self) -> None:
        super().__init__()
        self.total_size = self.num_pages * self.page_size
        self.alloc = HostTokenAllocator(self.total_size, self.page_size, strict=self.strict)
        self.free_list = list(range(self.total_size))
        self.release_list: list[int] = []
        self.free_set = set(self.free_list)
        self.held: list[list[int]] = []

    def model_alloc(self, num_tokens: int) -> list[int] | None:
        if num_tokens > len(self.free_list):
            if num_tokens > len(self.free_list) + len(self.release_list):
                return None
            self.free_list += self.release_list
            self.release_list = []
        slots, self.free_list = self.free_list[:num_tokens], self.free_list[num_tokens:]
        return slots

    @rule(num_pages=st.integers(0, 5))
    def alloc_pages(self, num_pages: int) -> None:
        num_tokens = num_pages * self.page_size
        expected = self.model_alloc(num_tokens)
        got = self.alloc.alloc(num_tokens)
        if expected is None:
            assert got is None
            return
        assert got is not None and got.dtype == np.int64
        assert got.tolist() == expected
        assert self.free_set >= set(expected), "handed out a slot that was not free"
        self.free_set -= set(expected)
        if expected:
            self.held.append(expected)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        """Free a whole allocation or, token-granular, part of one."""
        index = data.draw(st.integers(0, len(self.held) - 1), "allocation")
        slots = self.held.pop(index)
        keep = data.draw(st.integers(0, len(slots) - 1), "keep")
        freed, kept = slots[keep:], slots[:keep]
        if kept:
            self.held.append(kept)
        self.alloc.free(np.array(freed, dtype=np.int64))
        self.release_list += freed
        self.free_set |= set(freed)

    @precondition(lambda self: self.strict and self.free_set)
    @rule(data=st.data())
    def double_free_is_rejected(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.free_set)), "free_slot")
        with pytest.raises(PoolMisuseError, match=rf"\[host\] double free: slots already free: slots \[{slot}\]"):
            self.alloc.free(np.array([slot]))

    @rule(num_tokens=st.integers(1, 7))
    def misaligned_alloc_is_rejected(self, num_tokens: int) -> None:
        if num_tokens % self.page_size == 0:
            return
        with pytest.raises(PoolMisuseError, match=rf"alloc of {num_tokens} tokens is not a whole number of pages"):
            self.alloc.alloc(num_tokens)

    @invariant()
    def conserved(self) -> None:
        held = np.array([s for slots in self.held for s in slots], dtype=np.int64)
        self.alloc.check_integrity(held)
        assert self.alloc.available_size() == len(self.free_set)
        assert self.alloc.free_slots.tolist() == self.free_list
        assert self.alloc.release_slots.tolist() == self.release_list
        assert set(self.alloc.free_slot_ids().tolist()) == self.free_set


for _ps, _strict in ((1, False), (1, True), (4, False), (4, True)):
    _case = type(
        f"HostAlloc_ps{_ps}_strict{_strict}", (HostAllocatorMachine,), {"page_size": _ps, "strict": _strict}
    ).TestCase
    _case.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
    globals()[f"Test{_case.__qualname__.split('.')[0]}"] = _case
del _case


# -- strict mode and check_integrity ------------------------------------------------------


def test_double_free_names_pool_and_slots() -> None:
    alloc = HostTokenAllocator(16, 4, strict=True)
    got = alloc.alloc(8)
    assert got is not None and got.tolist() == list(range(8))
    alloc.free(got[:4])
    with pytest.raises(PoolMisuseError, match=r"\[host\] double free: slots already free: slots \[0, 1, 2, 3\]"):
        alloc.free(got[:4])
    with pytest.raises(PoolMisuseError, match=r"double free within one call: slots \[5\]"):
        alloc.free(np.array([5, 5]))
    with pytest.raises(PoolMisuseError, match=r"freeing slots outside \[0, 16\): slots \[16\]"):
        alloc.free(np.array([16]))
    with pytest.raises(PoolMisuseError, match=r"double free: slots already free: slots \[12\]"):
        alloc.free(np.array([12]))  # never allocated: free from the start
    alloc.check_integrity(got[4:])


def test_double_alloc_is_caught_in_strict_mode() -> None:
    """A double free slipped in before strict was on puts slot 2 on the release list twice;
    strict mode then rejects handing it out a second time."""
    alloc = HostTokenAllocator(4, 1)
    got = alloc.alloc(4)
    assert got is not None
    alloc.free(got[2:3])
    alloc.free(got[2:3])
    alloc.set_strict(True)
    first = alloc.alloc(1)
    assert first is not None and first.tolist() == [2]
    with pytest.raises(PoolMisuseError, match=r"\[host\] double alloc: slots already in use: slots \[2\]"):
        alloc.alloc(1)


def test_double_alloc_within_one_call_is_caught() -> None:
    alloc = HostTokenAllocator(4, 1)
    got = alloc.alloc(4)
    assert got is not None
    alloc.free(got[1:2])
    alloc.free(got[1:2])
    alloc.set_strict(True)
    with pytest.raises(PoolMisuseError, match=r"double alloc: the free list hands out a slot twice: slots \[1\]"):
        alloc.alloc(2)


def test_check_integrity_finds_a_double_free_without_strict() -> None:
    alloc = HostTokenAllocator(8, 1)
    got = alloc.alloc(4)
    assert got is not None
    alloc.free(got[:1])
    alloc.free(got[:1])
    with pytest.raises(IntegrityError, match=r"\[host\] slots free twice: \[0\]"):
        alloc.check_integrity()


def test_check_integrity_names_leaked_and_doubly_held_slots() -> None:
    alloc = HostTokenAllocator(8, 2, strict=True)
    got = alloc.alloc(6)
    assert got is not None
    with pytest.raises(IntegrityError, match=r"free 2 \+ held 4 != 8 slots; leaked slots \[4, 5\]"):
        alloc.check_integrity(got[:4])
    with pytest.raises(IntegrityError, match=r"slots both free and held: \[6\]"):
        alloc.check_integrity(np.concatenate((got, [6])))
    with pytest.raises(IntegrityError, match=r"slots held twice: \[0\]"):
        alloc.check_integrity(np.concatenate((got, [0])))
    alloc.check_integrity(got)


def test_check_integrity_finds_a_corrupted_slot_used_bitmap() -> None:
    alloc = HostTokenAllocator(8, 1, strict=True)
    alloc.alloc(2)
    assert alloc.slot_used is not None
    alloc.slot_used[5] = True
    with pytest.raises(IntegrityError, match=r"free slots marked used: \[5\]"):
        alloc.check_integrity()


def test_alloc_that_does_not_fit_consumes_nothing() -> None:
    alloc = HostTokenAllocator(8, 4, strict=True)
    got = alloc.alloc(4)
    assert got is not None
    alloc.free(got)
    assert alloc.alloc(12) is None
    assert alloc.available_size() == 8
    assert alloc.release_slots.tolist() == [0, 1, 2, 3]  # no merge when the allocation fails
    again = alloc.alloc(8)
    assert again is not None and again.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    alloc.check_integrity(again)


@pytest.mark.parametrize(("size_tokens", "page_size"), [(0, 1), (6, 4), (8, 0)])
def test_allocator_rejects_sizes_that_are_not_whole_pages(size_tokens: int, page_size: int) -> None:
    with pytest.raises(ValueError, match=r"\[host\]"):
        HostTokenAllocator(size_tokens, page_size)


# -- buffers ------------------------------------------------------------------------------


def test_host_kv_pool_shapes_bytes_and_pinning() -> None:
    pool = HostKVPool(3, 2, 8, torch.bfloat16, 12, v_head_dim=4)
    k, v = pool.get_kv_buffer(2)
    assert k.shape == (12, 2, 8) and v.shape == (12, 2, 4)
    assert k.device.type == "cpu" and k.dtype == torch.bfloat16
    assert pool.pinned == torch.cuda.is_available()
    assert pool.bytes_per_token == 2 * (8 + 4) * 2 * 3
    assert pool.bytes_used() == 12 * pool.bytes_per_token
    with pytest.raises(PoolMisuseError, match=r"layer 3 outside \[0, 3\)"):
        pool.get_kv_buffer(3)


def test_host_kv_pool_stores_fp8_as_bytes() -> None:
    pool = HostKVPool(1, 1, 4, torch.float8_e4m3fn, 4, pin_memory=False)
    assert pool.k_buffer[0].dtype == torch.uint8
    assert pool.get_kv_buffer(0)[0].dtype == torch.float8_e4m3fn


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_pinning_without_cuda_is_refused() -> None:
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        HostKVPool(1, 1, 4, torch.float32, 4, pin_memory=True)


@pytest.mark.cuda
def test_host_kv_pool_is_pinned_with_cuda() -> None:
    pool = HostKVPool(1, 1, 4, torch.float16, 8)
    assert pool.pinned and pool.k_buffer[0].is_pinned() and pool.v_buffer[0].is_pinned()
