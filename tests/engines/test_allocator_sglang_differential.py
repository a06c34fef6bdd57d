"""Differential: kvscope's TokenToKVPoolAllocator and PagedTokenToKVPoolAllocator against SGLang
0.5.18's own, on random call sequences (docs/memory-semantics.md §2.3-2.5).

NOTE: the calls, on requests' rows (a row: the slots of positions 0..n-1, page-aligned):
    new       alloc(n) (whole pages when paged), or alloc_extend from 0 for one or two rows
    extend    alloc_extend of a row by k tokens (its last slot as last_loc); page size 1: alloc(k)
    decode    alloc_decode of one to three rows; page size 1: alloc(one per row)
    finish    a row back by free(row), free_segments([(row[:a], 0), (row[a:], a)]) (the boundary
              page once) or free_segments of the whole row
    group     free_group_begin ... free_group_end around a few calls
    backup    backup_state, later restore_state (rows made or finished since are rolled back too);
              SGLang 0.5.18's allocators have no such method: its side saves and puts back its two
              lists, the whole of its state outside a group
After every call: the same slots returned (or both None), the same free and release lists.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engines.differential import allocators, same_free_lists, slots_alloc
from tests.engines.sglang518 import load_sglang_518, needs_source, sglang_518_source

SRC = sglang_518_source()
pytestmark = needs_source(SRC)


def one(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class Pair:
    def __init__(self, sgl: object, page_size: int, need_sort: bool) -> None:
        self.ps = page_size
        self.kv, self.sg = allocators(sgl, page_size, 32 * page_size, need_sort)
        self.rows: list[torch.Tensor] = []
        self.grouped = False
        self.saved: tuple[object, tuple[torch.Tensor, torch.Tensor], list[torch.Tensor]] | None = None

    def took(self, mine: torch.Tensor | None, theirs: torch.Tensor | None, where: str) -> bool:
        assert (mine is None) == (theirs is None), where
        if mine is None or theirs is None:
            return False
        assert mine.tolist() == theirs.tolist(), where
        return True

    def new(self, rng: np.random.Generator, where: str) -> None:
        ps = self.ps
        if ps == 1 or rng.random() < 0.3:
            n = int(rng.integers(1, 9)) * ps
            mine, theirs = self.kv.alloc(n), self.sg.alloc(n)
            if self.took(mine, theirs, where):
                self.rows.append(mine)
            return
        seqs = [int(n) for n in rng.integers(1, 4 * ps, size=int(rng.integers(1, 3)))]
        zeros, minus = [0] * len(seqs), [-1] * len(seqs)
        mine = self.kv.alloc_extend(zeros, seqs, minus, sum(seqs))
        theirs = self.sg.alloc_extend(one(zeros), one(zeros), one(seqs), one(seqs), one(minus), sum(seqs))
        if self.took(mine, theirs, where):
            assert mine is not None
            self.rows.extend(mine.split(seqs))

    def extend(self, rng: np.random.Generator, where: str) -> None:
        i = int(rng.integers(len(self.rows)))
        row = self.rows[i]
        p = len(row)
        mine, theirs = slots_alloc(self.kv, self.sg, self.ps, p, p + int(rng.integers(1, 3 * self.ps)), int(row[-1]))
        if self.took(mine, theirs, where):
            assert mine is not None
            self.rows[i] = torch.cat((row, mine))

    def decode(self, rng: np.random.Generator, where: str) -> None:
        picked = sorted({int(i) for i in rng.integers(len(self.rows), size=int(rng.integers(1, 4)))})
        if self.ps == 1:
            mine, theirs = self.kv.alloc(len(picked)), self.sg.alloc(len(picked))
        else:
            seqs, lasts = [len(self.rows[i]) + 1 for i in picked], [int(self.rows[i][-1]) for i in picked]
            mine = self.kv.alloc_decode(seqs, lasts)
            theirs = self.sg.alloc_decode(one(seqs), one(seqs), one(lasts))
        if self.took(mine, theirs, where):
            assert mine is not None
            for i, slot in zip(picked, mine.split(1), strict=True):
                self.rows[i] = torch.cat((self.rows[i], slot))

    def finish(self, rng: np.random.Generator) -> None:
        row = self.rows.pop(int(rng.integers(len(self.rows))))
        how, a = rng.integers(3), int(rng.integers(0, len(row) + 1))
        for alloc in (self.kv, self.sg):
            if how == 0:
                alloc.free(row.clone())
            elif how == 1:
                alloc.free_segments([(row[:a].clone(), 0), (row[a:].clone(), a)])
            else:
                alloc.free_segments([(row.clone(), 0)])

    def group(self) -> None:
        for alloc in (self.kv, self.sg):
            alloc.free_group_end() if self.grouped else alloc.free_group_begin()
        self.grouped = not self.grouped

    def backup_or_restore(self) -> None:
        if self.saved is None:
            self.saved = (self.kv.backup_state(), (self.sg.free_pages, self.sg.release_pages), list(self.rows))
            return
        mine, theirs, self.rows = self.saved
        self.kv.restore_state(mine)
        self.sg.free_pages, self.sg.release_pages = theirs
        self.saved = None


@settings(max_examples=40, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), need_sort=st.booleans(), seed=st.integers(0, 2**16))
def test_token_allocators_match_sglang_0_5_18_call_for_call(page_size: int, need_sort: bool, seed: int) -> None:
    assert SRC is not None
    pair = Pair(load_sglang_518(SRC), page_size, need_sort)
    rng = np.random.default_rng(seed)
    for i in range(120):
        where = f"call {i}"
        op = rng.random()
        if not pair.rows or op < 0.3:
            pair.new(rng, where)
        elif op < 0.5:
            pair.extend(rng, where)
        elif op < 0.65:
            pair.decode(rng, where)
        elif op < 0.85:
            pair.finish(rng)
        elif op < 0.93:
            pair.group()
        elif not pair.grouped:
            pair.backup_or_restore()
        same_free_lists(pair.kv, pair.sg, where)
        assert pair.kv.available_size() == pair.sg.available_size(), where
