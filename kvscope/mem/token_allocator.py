"""TokenToKVPoolAllocator (page size 1, docs/memory-semantics.md §2.3) and BaseTokenAllocator, the
free-list machinery it shares with the paged allocator. The contract is in base.py.

Slots 1..total_size start free in order; `alloc(n)` hands out the first n; `free` appends,
so reuse is FIFO.

NOTE: strict mode keeps one PageState per page on the host (index = page id, entry 0 the
padding page); `check_integrity` proves conservation from the free lists, the pages
pending in a free group, and the slots the caller says others own.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from kvscope.mem.base import INDEX_DTYPE, AllocatorState, BatchCharge, IntsLike, PoolUsage
from kvscope.mem.device import resolve_device
from kvscope.mem.errors import IntegrityError, PoolMisuseError
from kvscope.telemetry.events import NULL_RECORDER, EventKind, PoolName, Recorder


class PageState(IntEnum):
    NEVER_ALLOCATED = 0
    IN_USE = 1
    FREED = 2
    PADDING = 3


class BaseTokenAllocator:
    """Free lists, free groups, strict page states and the conservation proof shared by the
    page-size-1 and paged allocators."""

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
                f"[{name}] total_size must be a positive multiple of page_size ({page_size}), got {total_size}"
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
        self.active_batch: BatchCharge | None = None  # who shares a batched alloc (base.charged_to_batch)
        self.pool_name = PoolName(name) if name in PoolName._value2member_map_ else None
        self.clear()

    # -- state -------------------------------------------------------------------------

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=INDEX_DTYPE, device=self.device)
        self.release_pages = torch.empty(0, dtype=INDEX_DTYPE, device=self.device)
        self._free_group: list[torch.Tensor] | None = None
        self._segment_group: list[torch.Tensor] = []  # page ids from segment frees, paged only
        if self._strict:
            self._page_state = self._fresh_page_state()

    def _fresh_page_state(self) -> np.ndarray:
        state = np.full(self.num_pages + 1, PageState.NEVER_ALLOCATED, dtype=np.int8)
        state[0] = PageState.PADDING
        return state

    @property
    def full_attn_allocator(self) -> BaseTokenAllocator:
        return self

    @property
    def strict(self) -> bool:
        return self._strict

    def set_strict(self, strict: bool) -> None:
        """Turn strict tracking on or off. Turned on mid-run, pages now free count as FREED."""
        if strict and not self._strict:
            state = np.full(self.num_pages + 1, PageState.IN_USE, dtype=np.int8)
            state[0] = PageState.PADDING
            state[self.free_page_ids()] = PageState.FREED
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

    def alloc_extend(
        self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike, extend_num_tokens: int
    ) -> torch.Tensor | None:
        raise PoolMisuseError(self.name, "alloc_extend needs page_size > 1; use alloc() at page size 1")

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> torch.Tensor | None:
        raise PoolMisuseError(self.name, "alloc_decode needs page_size > 1; use alloc() at page size 1")

    def record_alloc(self, slots: Any) -> None:
        """One ALLOC event, or one per request inside `charged_to_batch`."""
        if self.active_batch is None:
            self.recorder.record(
                EventKind.ALLOC, pool=self.pool_name, rid=self.active_rid, num_tokens=len(slots), slots=slots
            )
            return
        rids, counts = self.active_batch.rids_and_counts()
        host = slots.cpu().numpy() if isinstance(slots, torch.Tensor) else slots  # numpy slices are cheaper
        self.recorder.record_batch(EventKind.ALLOC, pool=self.pool_name, rids=rids, num_tokens=counts, slots=host)

    def record_free(self, slots: Any) -> None:
        self.recorder.record(
            EventKind.FREE, pool=self.pool_name, rid=self.active_rid, num_tokens=len(slots), slots=slots
        )

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
        self._free(slots, self._free_group)

    def free_now(self, slots: torch.Tensor) -> None:
        """`free`, but straight to the free list even inside an open free group.

        SGLang 0.5.18's SWA allocator holds its free group itself, not in its two pools, so a
        free made on its full pool directly (the tombstone revive under a full lock) is not
        deferred (docs/memory-semantics.md §2.6)."""
        self._free(slots, None)

    def _free(self, slots: torch.Tensor, group: list[torch.Tensor] | None) -> None:
        """Check, record, then return the pages now, or hold them in `group` until it ends."""
        if slots.numel() == 0:
            return
        if self._strict:
            self._check_free(slots)
        if self.recorder.enabled:
            self.record_free(slots)
        if group is not None:
            group.append(slots)
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
            if ps == 1:
                self._free_group.append(slots)
            else:  # NOTE: segment frees, pages in chunk order (SGLang evicts with free_segment)
                self._segment_group.append(torch.from_numpy(joined[::ps] // ps).to(self.device))
            return
        if ps == 1 or len(chunks) == 1:
            pages = joined[::ps] // ps
        else:
            pages = np.concatenate([c[::ps] // ps for c in reversed(chunks)])
        self._return_pages(torch.from_numpy(pages).to(self.device))

    def _return_pages(self, pages: torch.Tensor) -> None:
        """To the release list with need_sort, else the free list: at its end at page size 1, in
        front when paged (as SGLang 0.5.18 does both)."""
        if self.reuse_order == "fifo":
            if self.need_sort:
                self.release_pages = torch.cat((self.release_pages, pages))
            else:
                self.free_pages = torch.cat((self.free_pages, pages))
        elif self.need_sort:
            self.release_pages = torch.cat((pages, self.release_pages))
        else:
            self.free_pages = torch.cat((pages, self.free_pages))

    def free_group_begin(self) -> None:
        """Defer frees until `free_group_end()`; groups do not nest."""
        if self._free_group is not None:
            raise PoolMisuseError(self.name, "free_group_begin inside an open free group")
        self._free_group = []
        self._segment_group = []

    def free_group_end(self) -> None:
        """Return the group's `free` pages (sorted, unique when paged), then, paged, the pages
        of its segment frees in call order in front of them (SGLang 0.5.18 and 0.5.23)."""
        if self._free_group is None:
            raise PoolMisuseError(self.name, "free_group_end without free_group_begin")
        group, self._free_group = self._free_group, None
        segments, self._segment_group = self._segment_group, []
        if group:
            self._return_pages(self.slots_to_pages(torch.cat(group)))
        if segments:
            self._return_pages(torch.cat(segments))

    @property
    def in_free_group(self) -> bool:
        return self._free_group is not None

    def _check_whole_pages(self, chunks: list[np.ndarray]) -> None:
        ps = self.page_size
        for chunk in chunks:
            if len(chunk) % ps or (chunk % ps != np.arange(len(chunk)) % ps).any():
                raise PoolMisuseError(self.name, "free_many chunk is not whole aligned pages", chunk[:16].tolist())

    # -- strict mode -------------------------------------------------------------------------

    def _mark_in_use(self, pages: torch.Tensor) -> None:
        assert self._page_state is not None
        self._page_state[pages.cpu().numpy()] = PageState.IN_USE

    def _check_free(self, slots: torch.Tensor) -> None:
        assert self._page_state is not None
        slots_np = slots.detach().cpu().numpy().astype(np.int64).reshape(-1)
        ps = self.page_size
        out_of_range = slots_np[(slots_np < 0) | (slots_np >= (self.num_pages + 1) * ps)]
        if len(out_of_range):
            raise PoolMisuseError(self.name, "freeing slots outside the pool", out_of_range.tolist())
        pages_np = slots_np // ps
        if ps == 1:
            uniq, counts = np.unique(pages_np, return_counts=True)
            if (counts > 1).any():
                raise PoolMisuseError(self.name, "double free within one call", uniq[counts > 1].tolist())
        pages_np = np.unique(pages_np)
        state = self._page_state[pages_np]
        for bad, problem in (
            (PageState.PADDING, "freeing the padding slot"),
            (PageState.FREED, "double free: slots already free"),
            (PageState.NEVER_ALLOCATED, "freeing slots that were never allocated"),
        ):
            hit = state == bad
            if hit.any():
                raise PoolMisuseError(self.name, problem, self._slots_on_pages(slots_np, pages_np[hit]))
        self._page_state[pages_np] = PageState.FREED

    def _slots_on_pages(self, slots_np: np.ndarray, pages_np: np.ndarray) -> list[int]:
        bad_pages = set(pages_np.tolist())
        return [int(s) for s in slots_np if s // self.page_size in bad_pages]

    # -- integrity -----------------------------------------------------------------------------

    def free_page_ids(self) -> np.ndarray:
        """Every free page id (free and release lists), int64 on the host."""
        return torch.cat((self.free_pages, self.release_pages)).cpu().numpy().astype(np.int64)

    def _pending_pages_np(self) -> np.ndarray:
        pending = [g.cpu().numpy().astype(np.int64) // self.page_size for g in self._free_group or ()]
        pending += [g.cpu().numpy().astype(np.int64) for g in self._segment_group]
        if not pending:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(pending))

    def check_integrity(self, owned_slots: Any = None) -> None:
        """Raise IntegrityError, printing the numbers, if any conservation rule is broken.

        `owned_slots`: every slot held outside the allocator (requests, tree, ...). When
        given, free + pending + owned must cover each usable page exactly once.
        """
        free = self.free_page_ids()
        uniq, counts = np.unique(free, return_counts=True)
        if (counts > 1).any():
            raise IntegrityError(f"[{self.name}] pages free twice: {uniq[counts > 1][:16].tolist()}")
        bad = free[(free < 1) | (free > self.num_pages)]
        if len(bad):
            raise IntegrityError(f"[{self.name}] free pages out of range [1, {self.num_pages}]: {bad[:16].tolist()}")
        pending = self._pending_pages_np()
        if self._page_state is not None:
            self._check_page_state(free, pending)
        if owned_slots is not None:
            self._check_owned(free, pending, owned_slots)

    def _check_page_state(self, free: np.ndarray, pending: np.ndarray) -> None:
        assert self._page_state is not None
        state = self._page_state[free]
        if (state == PageState.IN_USE).any():
            in_use = free[state == PageState.IN_USE][:16].tolist()
            raise IntegrityError(f"[{self.name}] free pages marked in use: {in_use}")
        num_in_use = int((self._page_state == PageState.IN_USE).sum())
        expected = self.num_pages - len(free) - len(pending)
        if num_in_use != expected:
            raise IntegrityError(
                f"[{self.name}] strict state has {num_in_use} pages in use, free lists imply {expected}"
            )

    def _check_owned(self, free: np.ndarray, pending: np.ndarray, owned_slots: Any) -> None:
        owned = np.asarray(
            owned_slots.cpu() if isinstance(owned_slots, torch.Tensor) else list(owned_slots),
            dtype=np.int64,
        ).reshape(-1)
        uniq, counts = np.unique(owned, return_counts=True)
        if (counts > 1).any():
            raise IntegrityError(f"[{self.name}] slots owned twice: {uniq[counts > 1][:16].tolist()}")
        owned_pages = np.unique(owned // self.page_size)
        if (owned_pages == 0).any():
            raise IntegrityError(f"[{self.name}] the padding page is owned")
        everything = np.concatenate((free, pending, owned_pages))
        uniq, counts = np.unique(everything, return_counts=True)
        twice = uniq[counts > 1]
        if len(twice):
            raise IntegrityError(f"[{self.name}] pages both free and owned: {twice[:16].tolist()}")
        if len(everything) != self.num_pages:
            missing = np.setdiff1d(np.arange(1, self.num_pages + 1), uniq)
            raise IntegrityError(
                f"[{self.name}] conservation broken: free {len(free)} + pending {len(pending)} + "
                f"owned {len(owned_pages)} != {self.num_pages} pages; leaked pages {missing[:16].tolist()}"
            )


class TokenToKVPoolAllocator(BaseTokenAllocator):
    reuse_order = "fifo"

    def __init__(
        self,
        total_size: int,
        device: str | torch.device | None = None,
        *,
        need_sort: bool = False,
        strict: bool = False,
        name: str = "full",
    ) -> None:
        super().__init__(total_size, 1, device, need_sort=need_sort, strict=strict, name=name)
