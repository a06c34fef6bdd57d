"""Slot arithmetic of paged allocation (docs/memory-semantics.md §2.4), in torch and in numpy.

NOTE: a request growing from prefix length p to sequence length s gets, in order:
    positions [p, min(s, ceil_ps(p)))  -> last_loc + 1, last_loc + 2, ... (its partial page)
    positions [ceil_ps(p), s)          -> fresh pages, one per started page
so it needs ceil(s/ps) - ceil(p/ps) new pages; requests take consecutive fresh pages in
batch order. A decode step (seq_len counts the new token) needs a fresh page exactly when
seq_len % ps == 1, else it continues at last_loc + 1.

The torch versions run on the pool's device (CUDA); the numpy twins compute the same
result on the host, where a dozen tiny torch ops would cost several times more.
"""

from __future__ import annotations

import numpy as np
import torch

INDEX_DTYPE = torch.int64


def extend_page_counts(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
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


def decode_slots(seq_lens: torch.Tensor, last_loc: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    if len(pages) == 0:
        return last_loc + 1
    needs_page = seq_lens % page_size == 1
    page_idx = (torch.cumsum(needs_page.to(INDEX_DTYPE), 0) - 1).clamp(min=0)
    return torch.where(needs_page, pages[page_idx] * page_size, last_loc + 1)


def extend_page_counts_np(prefix_lens: np.ndarray, seq_lens: np.ndarray, page_size: int) -> np.ndarray:
    return -(-seq_lens // page_size) - (-(-prefix_lens // page_size))


def extend_slots_np(
    prefix_lens: np.ndarray,
    seq_lens: np.ndarray,
    last_loc: np.ndarray,
    pages: np.ndarray,
    page_counts: np.ndarray,
    page_size: int,
) -> np.ndarray:
    """Per request: its partial-page run, then its fresh pages expanded and cut to length."""
    offsets = np.arange(page_size, dtype=np.int64)
    pieces = []
    first_page = 0
    for p, s, last, count in zip(
        prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist(), page_counts.tolist(), strict=True
    ):
        partial_end = min(s, -(-p // page_size) * page_size)
        if partial_end > p:
            pieces.append(np.arange(last + 1, last + 1 + partial_end - p, dtype=np.int64))
        if count:
            mine = pages[first_page : first_page + count]
            pieces.append((mine[:, None] * page_size + offsets).reshape(-1)[: s - partial_end])
            first_page += count
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


def decode_slots_np(seq_lens: np.ndarray, last_loc: np.ndarray, pages: np.ndarray, page_size: int) -> np.ndarray:
    out = last_loc + 1
    needs_page = seq_lens % page_size == 1
    out[needs_page] = pages * page_size
    return out
