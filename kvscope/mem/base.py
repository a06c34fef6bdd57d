"""The token-to-KV allocator contract, and the machinery every allocator shares.

An allocator hands out *slots*: row indices into the per-layer KV buffers. Slots are
grouped in pages of `page_size` consecutive slots (page_size 1: a page is a slot). The
free list holds page ids on the pool's device.

NOTE: slot map of a pool with `total_size` usable tokens and page size `ps`:
    ps == 1: slot 0 is padding; usable slots are [1, total_size].
    ps  > 1: page 0 (slots [0, ps)) is padding; usable pages are [1, total_size // ps],
             usable slots [ps, total_size + ps).
The KV buffers therefore have `total_size + ps` rows.

Contract (all allocators):
- `alloc(num_tokens)` returns a new int64 tensor of slots on the device, or None when
  there are not enough free pages; on None nothing is consumed. Returned slots stay owned
  by the caller until passed to `free`.
- `free(slots)` mutates: the pages of `slots` go back to the free list (page size 1: the
  slots themselves, appended, FIFO reuse; paged: every page touched, prepended, LIFO
  reuse). Inside a free group the pages come back only at `free_group_end()`. With
  `need_sort` they are parked in the release list and merged, sorted, when an allocation
  cannot be met from the free list alone.
- `available_size()` counts tokens: free plus released pages times `page_size`.
- `backup_state()` / `restore_state()` snapshot and roll back the free lists.
- `check_integrity(owned_slots)` proves conservation: the free list has no duplicate and
  no padding page, every free page is in range, and, given the slots held by everyone
  else, free + pending-in-group + owned covers every usable page exactly once.

Strict mode (`strict=True`, or `set_strict(True)`) tracks each page's state on the host
and rejects misuse where it happens, naming the pool and the slots: double free, freeing
the padding slot, freeing a slot never allocated, page-misaligned paged allocation.
Off, the hot path pays one flag check.

Telemetry: with a recorder attached (`allocator.recorder = ...`), every allocation and
every free is recorded as an ALLOC / FREE event with the pool, the slots, and
`active_rid`, the request the caller says it is working for (None: the tree's own frees);
a batched allocation for many requests is split per request by `active_batch`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch

from kvscope.mem.allocator_checks import AllocatorChecks, PageState
from kvscope.mem.device import resolve_device
from kvscope.mem.errors import PoolMisuseError
from kvscope.telemetry.events import NULL_RECORDER, EventKind, PoolName, Recorder

INDEX_DTYPE = torch.int64


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


class BaseTokenAllocator(AllocatorChecks):
    """Free-list bookkeeping shared by the page-size-1 and paged allocators."""

    reuse_order: ClassVar[Literal["fifo", "lifo"]] = "fifo"

    def __init__(
        self,
        total_size: int,
        page_size: int,
        device: str | torch.device | None = None,
        *,
        need_sort: bool = False,
        strict: bool = False,
        name: str = "full",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"[{name}] page_size must be >= 1, got {page_size}")
        if total_size < page_size or total_size % page_size:
            raise ValueError(
                f"[{name}] total_size must be a positive multiple of page_size "
                f"({page_size}), got {total_size}"
            )
        self.name = name
        self.page_size = page_size
        self.total_size = total_size
        self.num_pages = total_size // page_size
        self.device = resolve_device(device)
        self.on_host = self.device.type == "cpu"  # page math in numpy rather than tiny torch ops
        self.need_sort = need_sort
        self._strict = strict
        self._page_state: np.ndarray | None = None
        self.recorder: Recorder = NULL_RECORDER
        self.active_rid: str | None = None
        self.active_batch: list[tuple[str, int]] | None = None  # (rid, tokens) per request of a batched alloc
        self.pool_name = PoolName(name) if name in PoolName._value2member_map_ else None
        self.clear()

    # -- state -------------------------------------------------------------------------

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=INDEX_DTYPE, device=self.device)
        self.release_pages = torch.empty(0, dtype=INDEX_DTYPE, device=self.device)
        self._free_group: list[torch.Tensor] | None = None
        if self._strict:
            self._page_state = self._fresh_page_state()

    def _fresh_page_state(self) -> np.ndarray:
        state = np.full(self.num_pages + 1, PageState.NEVER_ALLOCATED, dtype=np.int8)
        state[0] = PageState.PADDING
        return state

    @property
    def strict(self) -> bool:
        return self._strict

    def set_strict(self, strict: bool) -> None:
        """Turn strict tracking on or off. Turned on mid-run, pages now free count as FREED."""
        if strict and not self._strict:
            state = np.full(self.num_pages + 1, PageState.IN_USE, dtype=np.int8)
            state[0] = PageState.PADDING
            state[self._all_free_pages_np()] = PageState.FREED
            self._page_state = state
        elif not strict:
            self._page_state = None
        self._strict = strict

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def usage(self) -> PoolUsage:
        return PoolUsage(self.total_size, self.available_size())

    def backup_state(self) -> AllocatorState:
        state = None if self._page_state is None else self._page_state.copy()
        return AllocatorState(self.free_pages, self.release_pages, state)

    def restore_state(self, state: AllocatorState) -> None:
        self.free_pages, self.release_pages = state.free_pages, state.release_pages
        if self._strict and state.page_state is not None:
            self._page_state = state.page_state.copy()
        elif self._strict:  # snapshot taken before strict was on: rebuild from the free lists
            self._strict = False
            self.set_strict(True)

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages) == 0:
            return
        merged = torch.cat((self.free_pages, self.release_pages))
        self.free_pages = torch.sort(merged).values
        self.release_pages = torch.empty(0, dtype=INDEX_DTYPE, device=self.device)

    # -- allocation ------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """`num_tokens` slots (a multiple of page_size when paged) or None if too few free."""
        if num_tokens % self.page_size:
            raise PoolMisuseError(
                self.name, f"page-misaligned alloc of {num_tokens} tokens (page_size {self.page_size})"
            )
        pages = self._take_pages(num_tokens // self.page_size)
        if pages is None:
            return None
        slots = self.pages_to_slots(pages)
        if self.recorder.enabled:
            self.record_alloc(slots)
        return slots

    def record_alloc(self, slots: Any) -> None:
        """One ALLOC event, or one per request when the caller set `active_batch`."""
        if self.active_batch is None:
            self.recorder.record(EventKind.ALLOC, pool=self.pool_name, rid=self.active_rid, num_tokens=len(slots),
                                 slots=slots)
            return
        host = slots.cpu().numpy() if isinstance(slots, torch.Tensor) else slots  # numpy slices are cheaper
        start = 0
        for rid, num_tokens in self.active_batch:
            self.recorder.record(EventKind.ALLOC, pool=self.pool_name, rid=rid, num_tokens=num_tokens,
                                 slots=host[start : start + num_tokens])
            start += num_tokens

    def record_free(self, slots: Any) -> None:
        self.recorder.record(EventKind.FREE, pool=self.pool_name, rid=self.active_rid, num_tokens=len(slots),
                             slots=slots)

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if self.need_sort and num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        if self._strict:
            self._mark_in_use(pages)
        return pages

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, dtype=INDEX_DTYPE, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """Pages that `slots` touch: the slots themselves at page size 1, else unique pages."""
        if self.page_size == 1:
            return slots.to(INDEX_DTYPE)
        return torch.unique(slots.to(INDEX_DTYPE) // self.page_size)

    # -- freeing ---------------------------------------------------------------------------

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if self._strict:
            self._check_free(slots)
        if self.recorder.enabled:
            self.record_free(slots)
        if self._free_group is not None:
            self._free_group.append(slots)
            return
        self._return_pages(self.slots_to_pages(slots))

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        """Free contiguous pieces (slots, start position) of one request's row."""
        pieces = [slots for slots, _ in segments if slots.numel()]
        if pieces:
            self.free(torch.cat(pieces))

    def free_many(self, chunks: list[np.ndarray]) -> None:
        """Same free lists as `free_segments([(chunk, 0)])` for each chunk in turn, in one update.

        This is how SGLang's radix eviction frees leaves. Each chunk is whole aligned pages
        (as tree node values are), so its pages are its every page_size-th slot, in row
        order. Paged and without a group, each call prepends its pages, so the chunks'
        pages go in front in reverse chunk order.
        """
        chunks = [c for c in chunks if len(c)]
        if not chunks:
            return
        joined = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        slots = torch.from_numpy(joined).to(self.device)
        ps = self.page_size
        if self._strict:
            self._check_whole_pages(chunks)
            self._check_free(slots)
        if self.recorder.enabled:
            self.record_free(slots)
        if self._free_group is not None:
            self._free_group.append(slots)
            return
        if ps == 1 or self.need_sort or len(chunks) == 1:
            pages = joined[::ps] // ps
        else:
            pages = np.concatenate([c[::ps] // ps for c in reversed(chunks)])
        self._return_pages(torch.from_numpy(pages).to(self.device))

    def _return_pages(self, pages: torch.Tensor) -> None:
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        elif self.reuse_order == "fifo":
            self.free_pages = torch.cat((self.free_pages, pages))
        else:
            self.free_pages = torch.cat((pages, self.free_pages))

    def free_group_begin(self) -> None:
        """Defer frees until `free_group_end()`; groups do not nest."""
        if self._free_group is not None:
            raise PoolMisuseError(self.name, "free_group_begin inside an open free group")
        self._free_group = []

    def free_group_end(self) -> None:
        if self._free_group is None:
            raise PoolMisuseError(self.name, "free_group_end without free_group_begin")
        group, self._free_group = self._free_group, None
        if group:
            self._return_pages(self.slots_to_pages(torch.cat(group)))

    @property
    def in_free_group(self) -> bool:
        return self._free_group is not None
