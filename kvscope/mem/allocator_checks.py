"""Strict-mode checks and the conservation proof of the token allocators.

Strict mode keeps one state per page on the host (never allocated, in use, freed, padding)
and rejects misuse where it happens; `check_integrity` proves conservation from the free
lists, the pages pending in a free group, and the slots the caller says others own.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import numpy as np
import torch

from kvscope.mem.errors import IntegrityError, PoolMisuseError


class PageState(IntEnum):
    NEVER_ALLOCATED = 0
    IN_USE = 1
    FREED = 2
    PADDING = 3



class AllocatorChecks:
    """Mixed into BaseTokenAllocator; uses its free lists and page geometry."""

    name: str
    page_size: int
    num_pages: int
    free_pages: torch.Tensor
    release_pages: torch.Tensor
    _page_state: np.ndarray | None
    _free_group: list[torch.Tensor] | None

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

    def _all_free_pages_np(self) -> np.ndarray:
        return torch.cat((self.free_pages, self.release_pages)).cpu().numpy().astype(np.int64)

    def _pending_pages_np(self) -> np.ndarray:
        if not self._free_group:
            return np.empty(0, dtype=np.int64)
        pending = torch.cat(self._free_group).cpu().numpy().astype(np.int64)
        return np.unique(pending // self.page_size)

    def check_integrity(self, owned_slots: Any = None) -> None:
        """Raise IntegrityError, printing the numbers, if any conservation rule is broken.

        `owned_slots`: every slot held outside the allocator (requests, tree, ...). When
        given, free + pending + owned must cover each usable page exactly once.
        """
        free = self._all_free_pages_np()
        uniq, counts = np.unique(free, return_counts=True)
        if (counts > 1).any():
            raise IntegrityError(f"[{self.name}] pages free twice: {uniq[counts > 1][:16].tolist()}")
        bad = free[(free < 1) | (free > self.num_pages)]
        if len(bad):
            raise IntegrityError(
                f"[{self.name}] free pages out of range [1, {self.num_pages}]: {bad[:16].tolist()}"
            )
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
