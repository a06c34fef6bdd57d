"""What the differential tests against SGLang 0.5.18 share: a tick clock both trees stamp nodes
with, the random token sequences, the pair of allocators, and the side-by-side comparisons of
allocators and trees.

NOTE: why a tick clock. Both trees stamp nodes with time.monotonic(); SGLang breaks a tie in its
eviction heap by whatever order its set of leaves iterates in (object addresses), kvscope by node
id. A clock that moves on at every call, as the real one does at nanosecond resolution, gives no
two evictable leaves the same stamp on either side, so the policies alone decide the eviction
order, and a run replays exactly. The two trees read it a different number of times (SGLang
stamps a new node twice), so stamps are compared by the order they put the leaves in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import numpy as np
import torch

from kvscope.cache.base import TOKEN_DTYPE
from kvscope.mem import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


class TickClock:
    """Stands for the `time` module in the trees' modules: monotonic() is later at every call."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now

    def perf_counter(self) -> float:  # NOTE: SGLang times its evictions for metrics only
        return time.perf_counter()


@contextmanager
def tick_clock(*modules: Any) -> Iterator[TickClock]:
    """One TickClock as the `time` of every module in `modules` while the block runs."""
    clock = TickClock()
    with ExitStack() as stack:
        for module in modules:
            stack.enter_context(mock.patch.object(module, "time", clock))
        yield clock


def tokens(rng: np.random.Generator, earlier: list[np.ndarray], longest: int = 60) -> np.ndarray:
    """A sequence that shares a random prefix with an earlier one most of the time."""
    keep = np.empty(0, dtype=np.int32)
    if earlier and rng.random() < 0.8:
        base = earlier[rng.integers(len(earlier))]
        keep = base[: rng.integers(0, len(base) + 1)]
    tail = rng.integers(0, 3, size=rng.integers(1, 24)).astype(np.int32)
    return np.concatenate((keep, tail))[:longest]


def allocators(sgl: object, page_size: int, size: int, need_sort: bool) -> tuple[object, object]:
    """kvscope's and SGLang's allocator of one size: the token allocator at page size 1, else paged."""
    if page_size == 1:
        mine: object = TokenToKVPoolAllocator(size, "cpu", need_sort=need_sort, strict=True)
        theirs = sgl.TokenToKVPoolAllocator(size, torch.int64, "cpu", None, need_sort)
    else:
        mine = PagedTokenToKVPoolAllocator(size, page_size, "cpu", need_sort=need_sort, strict=True)
        theirs = sgl.PagedTokenToKVPoolAllocator(size, page_size, torch.int64, "cpu", None, need_sort)
    return mine, theirs


def same_free_lists(mine: Any, theirs: Any, where: str) -> None:
    """The same free pages and release pages, in the same order."""
    assert mine.free_pages.tolist() == theirs.free_pages.tolist(), f"{where}: free_pages"
    assert mine.release_pages.tolist() == theirs.release_pages.tolist(), f"{where}: release_pages"


def slots_alloc(mine: Any, theirs: Any, ps: int, p: int, s: int, last: int) -> tuple[Any, Any]:
    """Slots for positions [p, s) of one request from both allocators: alloc at page size 1,
    alloc_extend (last: the slot of position p - 1, or -1) when paged."""
    if ps == 1:
        return mine.alloc(s - p), theirs.alloc(s - p)
    one = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    return mine.alloc_extend([p], [s], [last], s - p), theirs.alloc_extend(
        one(p), one(p), one(s), one(s), one(last), s - p
    )


Tree = tuple[dict[tuple[int, ...], tuple[Any, ...]], list[tuple[int, ...]], list[tuple[int, ...]]]


def tree_view(root: Any, key_tokens: Callable[[Any], list[int]], slots: Callable[[Any], list[int]]) -> Tree:
    """A tree as ({path tokens: (slots, lock_ref, hit_count, priority)}, the evictable leaves'
    paths from least to most recently accessed, the same from oldest to newest created)."""
    nodes: dict[tuple[int, ...], tuple[Any, ...]] = {}
    leaves: list[tuple[Any, tuple[int, ...]]] = []
    stack = [(child, ()) for child in root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + tuple(key_tokens(node))
        nodes[path] = (slots(node), node.lock_ref, node.hit_count, node.priority)
        if not node.children and node.lock_ref == 0:
            leaves.append((node, path))
        stack.extend((child, path) for child in node.children.values())
    by_access = [path for _, path in sorted(leaves, key=lambda leaf: leaf[0].last_access_time)]
    by_creation = [path for _, path in sorted(leaves, key=lambda leaf: leaf[0].creation_time)]
    return nodes, by_access, by_creation


def kvscope_tree(root: Any) -> Tree:
    return tree_view(root, lambda n: np.frombuffer(n.key, dtype=TOKEN_DTYPE).tolist(), lambda n: n.value.tolist())


def sglang_tree(root: Any) -> Tree:
    return tree_view(root, lambda n: [int(t) for t in n.key.token_ids], lambda n: n.value.tolist())
