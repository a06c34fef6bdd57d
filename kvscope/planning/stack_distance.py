"""Token-level stack distances of prompt prefixes over a radix trie, in one pass (docs/capacity-planning.md §6).

NOTE: the model. Requests are served one at a time, in order. Request i matches its prompt P_i
and then its whole sequence S_i = P_i + O_i (page-floored) is touched and inserted. Items are
pages of the trie of every path seen so far; an item's key is (last request that touched it,
-depth). A tree that may hold K tokens holds the K tokens with the highest keys: an ancestor
always outranks its descendants, so that set is prefix-closed (a valid radix tree), and the
lowest item is always the tail page of the coldest leaf, the one page-granular LRU eviction
(`RadixCache(eviction_granularity="page")`) removes next. The content at K is the top K of one
global order, for every K at once (Mattson's inclusion property), so

    hit_i(K) = tokens of page_floor(P_i) whose pre-request rank is within K

NOTE: node granularity. The trie is compressed into nodes; every token of a node shares its
key, and the node's tokens sit next to each other in the order, shallowest first. Each node
holds one logical stamp, and a Fenwick tree over stamps holds the node weights (tokens), so
    S(n) = weight of the nodes with a larger stamp   (tokens ranked above n)
and n's prompt part of w' tokens contributes the ramp clamp(K - S(n), 0, w') to hit_i(K).
Per request: take every S against the pre-request state, then re-stamp the path deepest
first (a new leaf first of all), so that ancestors get the larger stamps. A split leaves both
pieces on the old stamp, and the upper piece (on the path) is re-stamped in the same request,
so a stamp never holds more than one piece when it is read. Cost: O(path nodes · log stamps)
per request, about the cost of one replay, for the whole curve.

NOTE: namespaces. Given a namespace per request (a principal), each namespace walks its own
root, so no two namespaces share a node, while every node of every namespace sits in the one
stamp order: the curve of a cache where each principal keeps its own copies under one shared
capacity (per-principal isolation, k = inf). This is the same as prefixing every sequence with
a sentinel page per principal, without counting the sentinel as a token.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import NamedTuple

import numpy as np

TOKEN_BYTES = 4


class Ramps(NamedTuple):
    """One row per (request, prompt node present before the request): the node's first
    prompt token ranks `start` tokens deep, and its `length` prompt tokens follow."""

    request: np.ndarray  # int64, request index
    start: np.ndarray  # int64, S(n) in tokens
    length: np.ndarray  # int64, w' in tokens
    num_tokens_in_trie: int  # tokens of the whole trie at the end (the working set)


class _Node:
    __slots__ = ("children", "key", "stamp")

    def __init__(self, key: bytes, stamp: int) -> None:
        self.key = key
        self.stamp = stamp
        self.children: dict[bytes, _Node] = {}


class _Fenwick:
    """Point add and prefix sum over stamps 1..capacity; doubles when a stamp outgrows it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tree = [0] * (capacity + 1)
        self.values = [0] * (capacity + 1)
        self.total = 0

    def add(self, stamp: int, delta: int) -> None:
        if stamp > self.capacity:
            self._grow(stamp)
        self.values[stamp] += delta
        self.total += delta
        tree, n = self.tree, self.capacity
        while stamp <= n:
            tree[stamp] += delta
            stamp += stamp & -stamp

    def above(self, stamp: int) -> int:
        """Total weight at stamps > stamp."""
        total, tree = 0, self.tree
        while stamp > 0:
            total += tree[stamp]
            stamp -= stamp & -stamp
        return self.total - total

    def _grow(self, stamp: int) -> None:
        capacity = self.capacity
        while capacity < stamp:
            capacity *= 2
        values = self.values + [0] * (capacity - self.capacity)
        tree = values[:]
        for i in range(1, capacity + 1):  # O(n) build
            parent = i + (i & -i)
            if parent <= capacity:
                tree[parent] += tree[i]
        self.capacity, self.values, self.tree = capacity, values, tree


def common_len(node_key: bytes, key: bytes, pos: int, page_size: int) -> int:
    """Tokens node_key shares with key[pos:], rounded down to whole pages (as RadixCache does)."""
    a = np.frombuffer(node_key, dtype=np.int32)
    b = np.frombuffer(key, dtype=np.int32, offset=pos)[: len(a)]
    a = a[: len(b)]
    diff = np.flatnonzero(a != b)
    shared = int(diff[0]) if len(diff) else len(a)
    return shared // page_size * page_size


def stack_distance_ramps(
    sequences: Iterable[tuple[int, np.ndarray]], page_size: int, namespaces: Iterable[Hashable] | None = None
) -> Ramps:
    """The ramps of every request. `sequences` yields (prompt_len, prompt + output as int32);
    `namespaces`, when given, yields each request's namespace (see the note on namespaces)."""
    trie = _StampedTrie(page_size)
    names = iter(namespaces) if namespaces is not None else None
    for i, (prompt_len, all_ids) in enumerate(sequences):
        key_len = len(all_ids) // page_size * page_size
        key = (all_ids if key_len == len(all_ids) else all_ids[:key_len]).tobytes()
        root = trie.root_of(next(names)) if names is not None else trie.root
        path, pos = trie.walk(key, root)
        trie.add_ramps(i, path, prompt_len // page_size * page_size * TOKEN_BYTES)
        trie.touch(root, path, key, pos)
    return Ramps(
        np.array(trie.ramp_request, dtype=np.int64),
        np.array(trie.ramp_start, dtype=np.int64),
        np.array(trie.ramp_length, dtype=np.int64),
        trie.num_tokens,
    )


class _StampedTrie:
    """The trie of every path seen so far, its nodes' stamps in a Fenwick tree, and the ramps."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.root = _Node(b"", 0)
        self.roots: dict[Hashable, _Node] = {}
        self.fenwick = _Fenwick(1 << 12)
        self.stamp = 0
        self.num_tokens = 0
        self.ramp_request: list[int] = []
        self.ramp_start: list[int] = []
        self.ramp_length: list[int] = []

    def root_of(self, namespace: Hashable) -> _Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = _Node(b"", 0)
        return root

    def walk(self, key: bytes, root: _Node) -> tuple[list[_Node], int]:
        """(nodes of `key` already under `root`, bytes of key they cover), the root itself not
        included; splits the last one where key leaves it, so the path ends on a node boundary."""
        path: list[_Node] = []
        node, pos, end, page_bytes = root, 0, len(key), self.page_bytes
        while pos < end:
            child = node.children.get(key[pos : pos + page_bytes])
            if child is None:
                break
            if not key.startswith(child.key, pos):
                cut = common_len(child.key, key, pos, self.page_size) * TOKEN_BYTES
                child = _split(node, child, cut, page_bytes)
            path.append(child)
            pos += len(child.key)
            node = child
        return path, pos

    def add_ramps(self, request: int, path: list[_Node], prompt_end: int) -> None:
        """One ramp per path node holding prompt tokens, against the pre-request order."""
        depth = 0
        for node in path:
            if depth >= prompt_end:
                break
            self.ramp_request.append(request)
            self.ramp_start.append(self.fenwick.above(node.stamp))
            self.ramp_length.append(min(len(node.key), prompt_end - depth) // TOKEN_BYTES)
            depth += len(node.key)

    def touch(self, root: _Node, path: list[_Node], key: bytes, pos: int) -> None:
        """Insert key[pos:] as a new leaf, then re-stamp deepest first: the leaf, then the path
        bottom-up, so ancestors get the larger stamps."""
        fenwick = self.fenwick
        if pos < len(key):
            self.stamp += 1
            weight = (len(key) - pos) // TOKEN_BYTES
            parent = path[-1] if path else root
            parent.children[key[pos : pos + self.page_bytes]] = _Node(key[pos:], self.stamp)
            fenwick.add(self.stamp, weight)
            self.num_tokens += weight
        for node in reversed(path):
            weight = len(node.key) // TOKEN_BYTES
            fenwick.add(node.stamp, -weight)
            self.stamp += 1
            node.stamp = self.stamp
            fenwick.add(self.stamp, weight)


def _split(parent: _Node, child: _Node, cut: int, page_bytes: int) -> _Node:
    """Cut `child` after `cut` bytes; the upper piece takes its place and shares its stamp."""
    upper = _Node(child.key[:cut], child.stamp)
    child.key = child.key[cut:]
    upper.children[child.key[:page_bytes]] = child
    parent.children[upper.key[:page_bytes]] = upper
    return upper
