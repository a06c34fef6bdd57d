"""PagedTokenToKVPoolAllocator: page size > 1 (semantics note §2.4).

NOTE: alignment invariant: position i of any request lives at a slot with
`slot % ps == i % ps`, so positions [k*ps, (k+1)*ps) of a request share one page.

NOTE: a request growing from prefix length p to sequence length s gets, in order:
    positions [p, min(s, ceil_ps(p)))  -> last_loc + 1, last_loc + 2, ... (its partial page)
    positions [ceil_ps(p), s)          -> fresh pages, one per started page
so it needs ceil(s/ps) - ceil(p/ps) new pages. A decode step (seq_len includes the new
token) needs a fresh page exactly when seq_len % ps == 1. Frees release every page
touched and prepend them: LIFO reuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvscope.mem.base import INDEX_DTYPE, BaseTokenAllocator, PageState
from kvscope.mem.errors import PoolMisuseError

IntsLike = torch.Tensor | Sequence[int]


def as_index_tensor(values: IntsLike, device: torch.device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=INDEX_DTYPE)
    return torch.tensor(list(values), dtype=INDEX_DTYPE, device=device)


def extend_page_counts(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """New pages each request needs to grow from prefix_lens to seq_lens."""
    return -(-seq_lens // page_size) - (-(-prefix_lens // page_size))


def extend_slots(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    pages: torch.Tensor,
    page_counts: torch.Tensor,
    extend_num_tokens: int,
    page_size: int,
) -> torch.Tensor:
    """Slots for every new position of every request, batch order, no per-token Python."""
    device = seq_lens.device
    extend_lens = seq_lens - prefix_lens
    batch = torch.arange(len(seq_lens), device=device)
    req_of_token = torch.repeat_interleave(batch, extend_lens, output_size=extend_num_tokens)
    token_start = torch.cumsum(extend_lens, 0) - extend_lens
    offsets = torch.arange(extend_num_tokens, dtype=INDEX_DTYPE, device=device)
    prefix = prefix_lens[req_of_token]
    positions = prefix + offsets - token_start[req_of_token]
    partial_slots = last_loc[req_of_token] + 1 + (positions - prefix)
    if len(pages) == 0:
        return partial_slots
    prefix_pages = -(-prefix_lens // page_size)
    page_start = torch.cumsum(page_counts, 0) - page_counts
    page_idx = page_start[req_of_token] + positions // page_size - prefix_pages[req_of_token]
    fresh_slots = pages[page_idx.clamp(min=0)] * page_size + positions % page_size
    in_partial_page = positions < prefix_pages[req_of_token] * page_size
    return torch.where(in_partial_page, partial_slots, fresh_slots)


def decode_slots(
    seq_lens: torch.Tensor, last_loc: torch.Tensor, pages: torch.Tensor, page_size: int
) -> torch.Tensor:
    needs_page = seq_lens % page_size == 1
    if len(pages) == 0:
        return last_loc + 1
    page_idx = (torch.cumsum(needs_page.to(INDEX_DTYPE), 0) - 1).clamp(min=0)
    return torch.where(needs_page, pages[page_idx] * page_size, last_loc + 1)


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
        prefix_t, seq_t, last_t = (as_index_tensor(v, self.device) for v in (prefix_lens, seq_lens, last_loc))
        if self._strict:
            self._check_extend_args(prefix_t, seq_t, last_t, extend_num_tokens)
        if self.need_sort and extend_num_tokens // self.page_size + len(seq_t) + 1 > len(self.free_pages):
            self.merge_and_sort_free()
        counts = extend_page_counts(prefix_t, seq_t, self.page_size)
        pages = self._take_pages(int(counts.sum()))
        if pages is None:
            return None
        return extend_slots(prefix_t, seq_t, last_t, pages, counts, extend_num_tokens, self.page_size)

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> torch.Tensor | None:
        """One slot per request for its new token; `seq_lens` already counts that token."""
        seq_t, last_t = as_index_tensor(seq_lens, self.device), as_index_tensor(last_loc, self.device)
        if self._strict:
            self._check_alignment(seq_t - 2, last_t, "decode")
        if self.need_sort and len(seq_t) > len(self.free_pages):
            self.merge_and_sort_free()
        pages = self._take_pages(int((seq_t % self.page_size == 1).sum()))
        if pages is None:
            return None
        return decode_slots(seq_t, last_t, pages, self.page_size)

    def free_segment(self, slots: torch.Tensor, start_pos: int) -> None:
        self.free_segments([(slots, start_pos)])

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        """Free contiguous pieces (slots, start position) of one request's row.

        One representative slot per page (a piece's first slot and each slot at a page
        start), pages returned in position order without sorting; where a piece starts on
        the page the previous one ended on, that page is freed once.
        """
        ps = self.page_size
        reps: list[torch.Tensor] = []
        last_page = -1
        for slots, start_pos in segments:
            if slots.numel() == 0:
                continue
            positions = start_pos + torch.arange(len(slots), device=slots.device)
            representative = positions % ps == 0
            representative[0] = int(slots[0]) // ps != last_page
            reps.append(slots[representative])
            last_page = int(slots[-1]) // ps
        if not reps or not (rep := torch.cat(reps)).numel():
            return
        if self._strict:
            self._check_free(rep)
        if self._free_group is not None:
            self._free_group.append(rep)
            return
        self._return_pages(rep.to(INDEX_DTYPE) // ps)

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
            raise PoolMisuseError(
                self.name, f"{what} continues a page that is not allocated", last_t[dead].tolist()
            )
