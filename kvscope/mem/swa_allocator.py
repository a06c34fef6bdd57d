"""SWATokenToKVPoolAllocator: a full pool and a sliding-window pool in lockstep (docs/memory-semantics.md §2.6).

NOTE: callers only ever see *full* slots. `full_to_swa_index_mapping[full_slot]` is the
paired SWA slot, or 0 when none (never allocated, freed, or out of the window). The
mapping has `full_total_size + page_size + 1` entries; the last is -1 so that
translating last_loc == -1 gives -1.

Allocation takes the same number of pages from both pools and records the pairing.
`free(full)` frees both halves; `free_swa(full)` frees only the SWA half, page-granular,
and is harmless on positions whose SWA half is already gone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvscope.mem.base import INDEX_DTYPE, AllocatorState, BatchCharge, IntsLike, PoolUsage
from kvscope.mem.device import resolve_device
from kvscope.mem.errors import IntegrityError, PoolMisuseError
from kvscope.mem.page_math import decode_slots, extend_page_counts, extend_slots
from kvscope.mem.paged_allocator import PagedTokenToKVPoolAllocator, as_index_tensor
from kvscope.mem.token_allocator import BaseTokenAllocator, TokenToKVPoolAllocator
from kvscope.telemetry.events import Recorder


def make_token_allocator(
    total_size: int,
    page_size: int,
    device: str | torch.device | None = None,
    *,
    need_sort: bool = False,
    strict: bool = False,
    name: str = "full",
) -> BaseTokenAllocator:
    """The plain allocator at page size 1, the paged one above."""
    if page_size == 1:
        return TokenToKVPoolAllocator(total_size, device, need_sort=need_sort, strict=strict, name=name)
    return PagedTokenToKVPoolAllocator(total_size, page_size, device, need_sort=need_sort, strict=strict, name=name)


class SWAState(NamedTuple):
    full: AllocatorState
    swa: AllocatorState
    mapping: torch.Tensor


class SWATokenToKVPoolAllocator:
    def __init__(
        self,
        full_total_size: int,
        swa_total_size: int,
        page_size: int,
        device: str | torch.device | None = None,
        *,
        need_sort: bool = False,
        strict: bool = False,
    ) -> None:
        self.device = resolve_device(device)
        self.page_size = page_size
        self.full_attn_allocator = make_token_allocator(
            full_total_size, page_size, self.device, need_sort=need_sort, strict=strict, name="full"
        )
        self.swa_attn_allocator = make_token_allocator(
            swa_total_size, page_size, self.device, need_sort=need_sort, strict=strict, name="swa"
        )
        self.full_to_swa_index_mapping = torch.zeros(
            full_total_size + page_size + 1, dtype=INDEX_DTYPE, device=self.device
        )
        self.full_to_swa_index_mapping[-1] = -1

    # -- telemetry: both sub-allocators record their frees; allocations are recorded here --

    @property
    def recorder(self) -> Recorder:
        return self.full_attn_allocator.recorder

    @recorder.setter
    def recorder(self, recorder: Recorder) -> None:
        self.full_attn_allocator.recorder = self.swa_attn_allocator.recorder = recorder

    @property
    def active_rid(self) -> str | None:
        return self.full_attn_allocator.active_rid

    @active_rid.setter
    def active_rid(self, rid: str | None) -> None:
        self.full_attn_allocator.active_rid = self.swa_attn_allocator.active_rid = rid

    @property
    def active_batch(self) -> BatchCharge | None:
        return self.full_attn_allocator.active_batch

    @active_batch.setter
    def active_batch(self, batch: BatchCharge | None) -> None:
        self.full_attn_allocator.active_batch = self.swa_attn_allocator.active_batch = batch

    def _paired(self, full: torch.Tensor, swa: torch.Tensor) -> torch.Tensor:
        self.full_to_swa_index_mapping[full] = swa
        if self.full_attn_allocator.recorder.enabled:
            self.full_attn_allocator.record_alloc(full)
            self.swa_attn_allocator.record_alloc(swa)
        return full

    # -- sizes ---------------------------------------------------------------------------

    @property
    def total_size(self) -> int:
        return min(self.full_attn_allocator.total_size, self.swa_attn_allocator.total_size)

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def full_usage(self) -> PoolUsage:
        return self.full_attn_allocator.usage()

    def swa_usage(self) -> PoolUsage:
        return self.swa_attn_allocator.usage()

    def translate_loc(self, full_slots: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[full_slots]

    # -- allocation ----------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        pages_needed = num_tokens // self.page_size
        if not self._both_have(pages_needed):
            return None
        full_pages, swa_pages = self._take_both(pages_needed)
        full = self.full_attn_allocator.pages_to_slots(full_pages)
        return self._paired(full, self.swa_attn_allocator.pages_to_slots(swa_pages))

    def alloc_extend(
        self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike, extend_num_tokens: int
    ) -> torch.Tensor | None:
        self._require_paged("alloc_extend")
        prefix_t, seq_t, last_t = (as_index_tensor(v, self.device) for v in (prefix_lens, seq_lens, last_loc))
        counts = extend_page_counts(prefix_t, seq_t, self.page_size)
        pages_needed = int(counts.sum())
        if not self._both_have(pages_needed):
            return None
        ps = self.page_size
        self._merge_if_short(extend_num_tokens // ps + len(seq_t) + 1)
        full_pages, swa_pages = self._take_both(pages_needed)
        full = extend_slots(prefix_t, seq_t, last_t, full_pages, counts, extend_num_tokens, ps)
        swa_last = self.translate_loc(last_t)
        swa = extend_slots(prefix_t, seq_t, swa_last, swa_pages, counts, extend_num_tokens, ps)
        return self._paired(full, swa)

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> torch.Tensor | None:
        self._require_paged("alloc_decode")
        seq_t, last_t = as_index_tensor(seq_lens, self.device), as_index_tensor(last_loc, self.device)
        pages_needed = int((seq_t % self.page_size == 1).sum())
        if not self._both_have(pages_needed):
            return None
        self._merge_if_short(len(seq_t))
        full_pages, swa_pages = self._take_both(pages_needed)
        full = decode_slots(seq_t, last_t, full_pages, self.page_size)
        swa = decode_slots(seq_t, self.translate_loc(last_t), swa_pages, self.page_size)
        return self._paired(full, swa)

    def _require_paged(self, what: str) -> None:
        if self.page_size == 1:
            raise PoolMisuseError("swa", f"{what} needs page_size > 1; use alloc() at page size 1")

    def _both_have(self, num_pages: int) -> bool:
        """Both pools hold `num_pages`, release lists counted; checked before any merge, so a
        failed allocation merges nothing (SGLang 0.5.18's SWA allocator)."""
        num_tokens = num_pages * self.page_size
        return num_tokens <= self.full_available_size() and num_tokens <= self.swa_available_size()

    def _merge_if_short(self, min_free_pages: int) -> None:
        """need_sort: a pool whose free list is shorter than `min_free_pages` merges its release
        list first (the paged allocator's own rule for extend and decode, §2.5)."""
        for allocator in (self.full_attn_allocator, self.swa_attn_allocator):
            if allocator.need_sort and min_free_pages > len(allocator.free_pages):
                allocator.merge_and_sort_free()

    def _take_both(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        full = self.full_attn_allocator._take_pages(num_pages)
        swa = self.swa_attn_allocator._take_pages(num_pages)
        assert full is not None and swa is not None
        return full, swa

    # -- freeing -------------------------------------------------------------------------

    def free(self, full_slots: torch.Tensor) -> None:
        """Free both halves of `full_slots`. Not idempotent: the full half must be live."""
        if full_slots.numel() == 0:
            return
        swa = self.full_to_swa_index_mapping[full_slots]
        self.swa_attn_allocator.free(swa[swa > 0])
        self.full_to_swa_index_mapping[full_slots] = 0
        self.full_attn_allocator.free(full_slots)

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        pieces = [slots for slots, _ in segments if slots.numel()]
        if pieces:
            self.free(torch.cat(pieces))

    def free_swa(self, full_slots: torch.Tensor) -> None:
        """Free only the SWA half of every page `full_slots` touch; the full KV stays."""
        if full_slots.numel() == 0:
            return
        if self.page_size > 1:
            full_slots = self.full_attn_allocator.pages_to_slots(self.full_attn_allocator.slots_to_pages(full_slots))
        swa = self.full_to_swa_index_mapping[full_slots]
        live = swa > 0
        self.swa_attn_allocator.free(swa[live])
        self.full_to_swa_index_mapping[full_slots[live]] = 0

    def free_group_begin(self) -> None:
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        self.full_attn_allocator.free_group_end()
        self.swa_attn_allocator.free_group_end()

    # -- state ---------------------------------------------------------------------------

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping.zero_()
        self.full_to_swa_index_mapping[-1] = -1

    def set_strict(self, strict: bool) -> None:
        self.full_attn_allocator.set_strict(strict)
        self.swa_attn_allocator.set_strict(strict)

    def backup_state(self) -> SWAState:
        return SWAState(
            self.full_attn_allocator.backup_state(),
            self.swa_attn_allocator.backup_state(),
            self.full_to_swa_index_mapping.clone(),
        )

    def restore_state(self, state: SWAState) -> None:
        self.full_attn_allocator.restore_state(state.full)
        self.swa_attn_allocator.restore_state(state.swa)
        self.full_to_swa_index_mapping.copy_(state.mapping)

    def check_integrity(self, owned_full_slots: Any = None) -> None:
        """Both pools conserve; the SWA pool's owners are exactly the mapped entries."""
        mapping = self.full_to_swa_index_mapping
        if int(mapping[-1]) != -1 or int(mapping[0]) != 0:
            raise IntegrityError(
                f"[swa] mapping sentinels broken: mapping[0]={int(mapping[0])}, mapping[-1]={int(mapping[-1])}"
            )
        self.full_attn_allocator.check_integrity(owned_full_slots)
        mapped_full = torch.nonzero(mapping[:-1] > 0).flatten()
        self.swa_attn_allocator.check_integrity(mapping[mapped_full])
        ps = self.page_size
        free_full = set(self.full_attn_allocator.free_page_ids().tolist())
        stale = [int(s) for s in mapped_full.tolist() if s // ps in free_full]
        if stale:
            raise IntegrityError(f"[swa] free full slots still mapped to SWA slots: {stale[:16]}")
        if ps > 1:
            misaligned = mapped_full[(mapping[mapped_full] % ps) != (mapped_full % ps)]
            if len(misaligned):
                raise IntegrityError(f"[swa] full/SWA pairs not page-aligned: {misaligned[:16].tolist()}")
