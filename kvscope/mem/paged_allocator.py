"""PagedTokenToKVPoolAllocator: page size > 1 (docs/memory-semantics.md §2.4).

NOTE: alignment invariant: position i of any request lives at a slot with
`slot % ps == i % ps`, so positions [k*ps, (k+1)*ps) of a request share one page.
The slot arithmetic of extend and decode is in page_math. Frees release every page
touched and prepend them: LIFO reuse.
"""

from __future__ import annotations

import numpy as np
import torch

from kvscope.mem import page_math
from kvscope.mem.base import INDEX_DTYPE, IntsLike
from kvscope.mem.errors import PoolMisuseError
from kvscope.mem.token_allocator import BaseTokenAllocator, PageState


def as_index_tensor(values: IntsLike, device: torch.device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=INDEX_DTYPE)
    return torch.tensor(list(values), dtype=INDEX_DTYPE, device=device)


def as_index_array(values: IntsLike) -> np.ndarray:
    """Host int64 array (a copy: page math writes into its results)."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().astype(np.int64, copy=True)
    return np.array(values, dtype=np.int64)


class PagedTokenToKVPoolAllocator(BaseTokenAllocator):
    reuse_order = "lifo"

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
        if page_size < 2:
            raise ValueError(f"[{name}] the paged allocator needs page_size >= 2, got {page_size}")
        super().__init__(total_size, page_size, device, need_sort=need_sort, strict=strict, name=name)

    def alloc_extend(
        self,
        prefix_lens: IntsLike,
        seq_lens: IntsLike,
        last_loc: IntsLike,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for positions [prefix_len, seq_len) of each request, concatenated in batch order.

        `last_loc`: slot of each request's last prefix token, -1 when it has no prefix.
        Returns None, consuming nothing, when the free pages do not suffice.
        """
        if self._strict:
            prefix_t, seq_t, last_t = (as_index_tensor(v, self.device) for v in (prefix_lens, seq_lens, last_loc))
            self._check_extend_args(prefix_t, seq_t, last_t, extend_num_tokens)
        if self.need_sort and extend_num_tokens // self.page_size + len(seq_lens) + 1 > len(self.free_pages):
            self.merge_and_sort_free()
        ps = self.page_size
        if self.on_host:
            prefix_a, seq_a, last_a = (as_index_array(v) for v in (prefix_lens, seq_lens, last_loc))
            counts_a = page_math.extend_page_counts_np(prefix_a, seq_a, ps)
            pages = self._take_pages(int(counts_a.sum()))
            if pages is None:
                return None
            out = torch.from_numpy(page_math.extend_slots_np(prefix_a, seq_a, last_a, pages.numpy(), counts_a, ps))
        else:
            on_device = self._extend_on_device(prefix_lens, seq_lens, last_loc, extend_num_tokens)
            if on_device is None:
                return None
            out = on_device
        if self.recorder.enabled:
            self.record_alloc(out)
        return out

    def _extend_on_device(
        self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike, extend_num_tokens: int
    ) -> torch.Tensor | None:
        ps = self.page_size
        prefix_t, seq_t, last_t = (as_index_tensor(v, self.device) for v in (prefix_lens, seq_lens, last_loc))
        counts = page_math.extend_page_counts(prefix_t, seq_t, ps)
        pages = self._take_pages(int(counts.sum()))
        if pages is None:
            return None
        return page_math.extend_slots(prefix_t, seq_t, last_t, pages, counts, extend_num_tokens, ps)

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> torch.Tensor | None:
        """One slot per request for its new token; `seq_lens` already counts that token."""
        ps = self.page_size
        if self._strict:
            seq_t, last_t = as_index_tensor(seq_lens, self.device), as_index_tensor(last_loc, self.device)
            self._check_alignment(seq_t - 2, last_t, "decode")
        if self.need_sort and len(seq_lens) > len(self.free_pages):
            self.merge_and_sort_free()
        if self.on_host:
            seq_a, last_a = as_index_array(seq_lens), as_index_array(last_loc)
            pages = self._take_pages(int((seq_a % ps == 1).sum()))
            if pages is None:
                return None
            out = torch.from_numpy(page_math.decode_slots_np(seq_a, last_a, pages.numpy(), ps))
        else:
            seq_t, last_t = as_index_tensor(seq_lens, self.device), as_index_tensor(last_loc, self.device)
            pages = self._take_pages(int((seq_t % ps == 1).sum()))
            if pages is None:
                return None
            out = page_math.decode_slots(seq_t, last_t, pages, ps)
        if self.recorder.enabled:
            self.record_alloc(out)
        return out

    def free_segment(self, slots: torch.Tensor, start_pos: int) -> None:
        self.free_segments([(slots, start_pos)])

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        """Free contiguous pieces (slots, start position) of one request's row.

        One representative slot per page (a piece's first slot and each slot at a page
        start), each piece's pages unsorted in position order; where a piece starts on the
        page the previous one ended on, that page is freed once. As SGLang's one
        `free_segment` per piece: outside a group each piece's pages go in front in turn (the
        last piece first); in a group they wait apart from `free`'s pages (free_group_end).
        """
        ps = self.page_size
        reps: list[torch.Tensor] = []  # one slot per page, per piece
        last_page = -1
        for slots, start_pos in segments:
            if slots.numel() == 0:
                continue
            positions = start_pos + torch.arange(len(slots), device=slots.device)
            representative = positions % ps == 0
            representative[0] = int(slots[0]) // ps != last_page
            reps.append(slots[representative].to(INDEX_DTYPE))
            last_page = int(slots[-1]) // ps
        if not reps or not (rep := torch.cat(reps)).numel():
            return
        if self._strict:
            self._check_free(rep)
        if self.recorder.enabled:
            self.record_free(torch.cat([slots for slots, _ in segments if slots.numel()]))
        if self._free_group is not None:
            self._segment_group.append(rep // ps)
            return
        for piece in reps:
            if piece.numel():
                self._return_pages(piece // ps)

    # -- strict checks -----------------------------------------------------------------------

    def _check_extend_args(
        self, prefix_t: torch.Tensor, seq_t: torch.Tensor, last_t: torch.Tensor, extend_num_tokens: int
    ) -> None:
        if (seq_t < prefix_t).any():
            raise PoolMisuseError(self.name, "alloc_extend with seq_len < prefix_len")
        if int((seq_t - prefix_t).sum()) != extend_num_tokens:
            raise PoolMisuseError(
                self.name,
                f"alloc_extend: extend_num_tokens {extend_num_tokens} != sum of seq_len - prefix_len "
                f"({int((seq_t - prefix_t).sum())})",
            )
        has_prefix = prefix_t > 0
        self._check_alignment(prefix_t[has_prefix] - 1, last_t[has_prefix], "extend")

    def _check_alignment(self, last_positions: torch.Tensor, last_t: torch.Tensor, what: str) -> None:
        """The last existing token must sit at a slot aligned with its position, on a live page."""
        valid = last_positions >= 0
        last_positions, last_t = last_positions[valid], last_t[valid]
        misaligned = last_t % self.page_size != last_positions % self.page_size
        if misaligned.any():
            raise PoolMisuseError(
                self.name,
                f"page-misaligned {what}: last_loc % {self.page_size} != position % {self.page_size}",
                last_t[misaligned].tolist(),
            )
        assert self._page_state is not None
        pages = (last_t // self.page_size).cpu().numpy()
        dead = self._page_state[pages] != PageState.IN_USE
        if dead.any():
            raise PoolMisuseError(self.name, f"{what} continues a page that is not allocated", last_t[dead].tolist())
