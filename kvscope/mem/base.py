"""The token-to-KV allocator contract: the `TokenAllocator` protocol every allocator follows.

An allocator hands out *slots*: row indices into the per-layer KV buffers. Slots are
grouped in pages of `page_size` consecutive slots (page_size 1: a page is a slot). The
free list holds page ids on the pool's device.

NOTE: slot map of a pool with `total_size` usable tokens and page size `ps`:
    ps == 1: slot 0 is padding; usable slots are [1, total_size].
    ps  > 1: page 0 (slots [0, ps)) is padding; usable pages are [1, total_size // ps],
             usable slots [ps, total_size + ps).
The KV buffers therefore have `total_size + ps` rows.

The implementations: `TokenToKVPoolAllocator` (page size 1), `PagedTokenToKVPoolAllocator`
(page size > 1), both on the free-list machinery of `BaseTokenAllocator`; and
`SWATokenToKVPoolAllocator`, a full pool and a sliding-window pool in lockstep, whose
slots are the full pool's (see swa_allocator.py for what it adds). Callers that only
allocate, free and count take a `TokenAllocator` and never ask which one they hold.

Contract (all allocators):
- `alloc(num_tokens)` returns a new int64 tensor of slots on the device, or None when
  there are not enough free pages; on None nothing is consumed. Returned slots stay owned
  by the caller until passed to `free`. Paged: `num_tokens` is a multiple of page_size.
- `alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)` and
  `alloc_decode(seq_lens, last_loc)`: the page-aligned allocations of page size > 1 (slot
  arithmetic in page_math.py); None when the free pages do not suffice. At page size 1
  they refuse (PoolMisuseError): call `alloc`.
- `free(slots)` mutates: the pages of `slots` go back to the free list (page size 1: the
  slots themselves, appended, FIFO reuse; paged: every page touched, prepended, LIFO
  reuse). Inside a free group the pages come back only at `free_group_end()`. With
  `need_sort` they are parked in the release list and merged, sorted, when an allocation
  cannot be met from the free list alone.
- `free_segments([(slots, start_pos), ...])` frees contiguous pieces of one request's row
  (paged: each page once, in position order).
- `available_size()` counts tokens: free plus released pages times `page_size` (SWA: the
  smaller of its two pools).
- `backup_state()` / `restore_state()` snapshot and roll back the free lists.
- `check_integrity(owned_slots)` proves conservation: the free list has no duplicate and
  no padding page, every free page is in range, and, given the slots held by everyone
  else, free + pending-in-group + owned covers every usable page exactly once.
- `full_attn_allocator` is the allocator of the full-attention pool: the allocator itself,
  or the SWA allocator's full half.

Strict mode (`strict=True`, or `set_strict(True)`) tracks each page's state on the host
and rejects misuse where it happens, naming the pool and the slots: double free, freeing
the padding slot, freeing a slot never allocated, page-misaligned paged allocation.
Off, the hot path pays one flag check.

Telemetry: with a recorder attached (`allocator.recorder = ...`), every allocation and
every free is recorded as an ALLOC / FREE event with the pool, the slots, and the request
the caller says it is working for (None: the tree's own frees). The caller says so with
`charged_to(allocator, rid)` around the calls, or `charged_to_batch(allocator, owners,
num_tokens)` around one allocation for many requests (split per request, in order). Both
restore the previous owner in `finally`, and with recording off they set nothing (one
flag check). `active_rid` / `active_batch` are the state they scope; callers do not set it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from kvscope.telemetry.events import Recorder

if TYPE_CHECKING:
    from kvscope.mem.token_allocator import BaseTokenAllocator

INDEX_DTYPE = torch.int64

IntsLike = torch.Tensor | Sequence[int]


class PoolUsage(NamedTuple):
    """Token counts of one pool, as a usage sample needs them."""

    total_size: int
    available_size: int

    @property
    def used_size(self) -> int:
        return self.total_size - self.available_size


class AllocatorState(NamedTuple):
    free_pages: torch.Tensor
    release_pages: torch.Tensor
    page_state: np.ndarray | None


class Owner(Protocol):
    """Whoever an allocation is charged to (a request)."""

    @property
    def rid(self) -> str: ...


class BatchCharge(NamedTuple):
    """One allocation for many requests: owner i gets the next num_tokens[i] slots (an int:
    the same count for each)."""

    owners: Sequence[Owner]
    num_tokens: Sequence[int] | int

    def rids_and_counts(self) -> tuple[list[str], Sequence[int]]:
        counts = [self.num_tokens] * len(self.owners) if isinstance(self.num_tokens, int) else self.num_tokens
        return [owner.rid for owner in self.owners], counts


class TokenAllocator(Protocol):
    """What callers of any token allocator may use (the contract above)."""

    page_size: int
    device: torch.device
    recorder: Recorder
    active_rid: str | None
    active_batch: BatchCharge | None

    @property
    def total_size(self) -> int: ...

    @property
    def full_attn_allocator(self) -> BaseTokenAllocator: ...

    def available_size(self) -> int: ...

    def alloc(self, num_tokens: int) -> torch.Tensor | None: ...

    def alloc_extend(
        self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike, extend_num_tokens: int
    ) -> torch.Tensor | None: ...

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor) -> None: ...

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None: ...

    def free_group_begin(self) -> None: ...

    def free_group_end(self) -> None: ...

    def clear(self) -> None: ...

    def set_strict(self, strict: bool) -> None: ...

    def check_integrity(self, owned_slots: Any = None) -> None: ...


@contextmanager
def charged_to(allocator: TokenAllocator, rid: str | None) -> Iterator[None]:
    """Every allocation and free inside is recorded as `rid`'s; the previous owner is back
    afterwards, whatever was raised. Recording off: sets nothing."""
    if not allocator.recorder.enabled:
        yield
        return
    before, allocator.active_rid = allocator.active_rid, rid
    try:
        yield
    finally:
        allocator.active_rid = before


@contextmanager
def charged_to_batch(
    allocator: TokenAllocator, owners: Sequence[Owner], num_tokens: Sequence[int] | int
) -> Iterator[None]:
    """The one allocation inside is split per owner (see BatchCharge); nothing is read from
    `owners` until an event is recorded, so recording off builds nothing. Restored in `finally`."""
    if not allocator.recorder.enabled:
        yield
        return
    before, allocator.active_batch = allocator.active_batch, BatchCharge(owners, num_tokens)
    try:
        yield
    finally:
        allocator.active_batch = before
