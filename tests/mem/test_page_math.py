"""The numpy page math used for host pools equals the torch version used on devices."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.mem import page_math


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int]]:
    ps = draw(st.sampled_from([2, 4, 16]))
    prefixes = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
    seqs = [p + draw(st.integers(1, 40)) for p in prefixes]
    lasts = [-1 if p == 0 else 1000 * (i + 1) + (p - 1) % ps for i, p in enumerate(prefixes)]
    return ps, prefixes, seqs, lasts


@settings(max_examples=200, deadline=None)
@given(batch=batches())
def test_extend_slots_agree(batch: tuple[int, list[int], list[int], list[int]]) -> None:
    ps, prefixes, seqs, lasts = batch
    p_t, s_t, l_t = (torch.tensor(v) for v in (prefixes, seqs, lasts))
    counts = page_math.extend_page_counts(p_t, s_t, ps)
    pages = torch.arange(7, 7 + int(counts.sum())) * 3  # arbitrary distinct page ids
    expected = page_math.extend_slots(p_t, s_t, l_t, pages, counts, int((s_t - p_t).sum()), ps)
    p_a, s_a, l_a = (np.array(v, dtype=np.int64) for v in (prefixes, seqs, lasts))
    counts_a = page_math.extend_page_counts_np(p_a, s_a, ps)
    got = page_math.extend_slots_np(p_a, s_a, l_a, pages.numpy(), counts_a, ps)
    assert counts_a.tolist() == counts.tolist()
    assert got.tolist() == expected.tolist()


@settings(max_examples=200, deadline=None)
@given(ps=st.sampled_from([2, 4, 16]), seqs=st.lists(st.integers(2, 80), min_size=1, max_size=8))
def test_decode_slots_agree(ps: int, seqs: list[int]) -> None:
    lasts = [500 * (i + 1) + (s - 2) % ps for i, s in enumerate(seqs)]
    num_pages = sum(1 for s in seqs if s % ps == 1)
    pages = torch.arange(3, 3 + num_pages) * 5
    expected = page_math.decode_slots(torch.tensor(seqs), torch.tensor(lasts), pages, ps)
    got = page_math.decode_slots_np(np.array(seqs), np.array(lasts), pages.numpy(), ps)
    assert got.tolist() == expected.tolist()
