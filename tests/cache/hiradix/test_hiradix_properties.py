"""Hypothesis state machine of HiRadixCache against a reference model, for each write policy
and page sizes 1 and 4: inserts (with the eviction a caller does first), matches, device
eviction, host eviction, load-backs, write/load acknowledgements, held locks.

The model is the set of inserted sequences and, for each page-prefix of them, the tier that
holds it (device / device+host / host, or absent). The tier map is split-invariant, so it
is compared before and after every rule: each rule allows only its own tier transitions.
After every step:
- check_integrity(), and conservation on both tiers (device available + tree device tokens
  == device total; host available + tree host tokens == host total);
- the tier map is closed under prefixes (device prefixes, and through policies backed-up
  ones), and holds only prefixes of inserted sequences;
- held locks keep their prefixes on the device; an op in flight keeps something protected;
- every device slot and every host slot of the tree holds the K/V of its token and position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.cache import EvictParams
from kvscope.cache.hiradix import LOAD_BACK_MIN_TOKENS, HiTreeNode, WritePolicy
from kvscope.cache.hiradix.node import hi_walk
from tests.cache.hiradix.helpers import NUM_LAYERS, check_all, encoded_kv, insert_seq, make_tiers

Prefix = tuple[int, ...]
TierMap = dict[Prefix, str]

# NOTE: allowed (before, after) tier moves per rule; None = absent
EVICT_MOVES = {("device+host", "host"), ("device", None)}
# NOTE: write_back's writes may evict host leaves, also ones demoted earlier in the same call
WRITE_BACK_EVICT_MOVES = EVICT_MOVES | {("device", "host"), ("host", None), ("device+host", None)}
INSERT_MOVES = {
    (None, "device"),
    (None, "device+host"),
    ("device", "device+host"),
    ("host", "device+host"),
    ("host", None),
}
LOAD_MOVES = {("host", "device+host")}
HOST_EVICT_MOVES = {("host", None)}

# NOTE: conversations: two long shared openings, then a few pages of their own, or random pages
OPENINGS = [[0] * 6 + [1] * 6, [2, 1, 0] * 4]
PAGES = st.one_of(
    st.lists(st.integers(0, 2), min_size=1, max_size=16),
    st.tuples(st.sampled_from(OPENINGS), st.lists(st.integers(0, 2), max_size=4)).map(lambda p: p[0] + p[1]),
)


class HiRadixMachine(RuleBasedStateMachine):
    policy: WritePolicy = "write_through"
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.t = make_tiers(self.policy, ps, device_tokens=40 * ps, host_tokens=48 * ps)
        self.cache = self.t.cache
        self.inserted: set[Prefix] = set()
        self.locks: list[tuple[HiTreeNode, Prefix]] = []
        self.tiers: TierMap = {}

    # -- the model -------------------------------------------------------------------------

    def tier_map(self) -> TierMap:
        """Page-prefix -> tier, from the tree."""
        out: TierMap = {}
        paths: dict[int, Prefix] = {self.cache.root.id: ()}
        for node, _, _ in hi_walk(self.cache.root):
            if node is self.cache.root:
                continue
            assert node.parent is not None
            base = paths[node.parent.id]
            tokens = tuple(node.token_ids().tolist())
            paths[node.id] = base + tokens
            for end in range(self.page_size, len(tokens) + 1, self.page_size):
                out[base + tokens[:end]] = node.tier
        return out

    def moved(self, allowed: set[tuple[str | None, str | None]]) -> TierMap:
        """Compare the tree's tier map with the model's, allowing `allowed` moves; adopt it."""
        now = self.tier_map()
        for prefix in set(now) | set(self.tiers):
            move = (self.tiers.get(prefix), now.get(prefix))
            assert move[0] == move[1] or move in allowed, (prefix, move, self.cache.pretty_print())
        for _, prefix in self.locks:
            for end in range(self.page_size, len(prefix) + 1, self.page_size):
                assert now.get(prefix[:end]) in ("device", "device+host"), (prefix[:end], now.get(prefix[:end]))
        self.tiers = now
        return now

    def evict_moves(self) -> set[tuple[str | None, str | None]]:
        return WRITE_BACK_EVICT_MOVES if self.policy == "write_back" else EVICT_MOVES

    def seq(self, pages: list[int]) -> np.ndarray:
        """Page p holds tokens p, p + 3, p + 6, ...: a page's first token names it."""
        offsets = np.arange(self.page_size, dtype=np.int32) * 3
        return np.repeat(np.array(pages, dtype=np.int32), self.page_size) + np.tile(offsets, len(pages))

    # -- rules -----------------------------------------------------------------------------

    @rule(pages=PAGES, ack=st.booleans())
    def insert(self, pages: list[int], ack: bool) -> None:
        ids = self.seq(pages)
        shortfall = len(ids) - self.t.allocator.available_size()
        if shortfall > 0:
            self.cache.evict(EvictParams(min(shortfall, self.cache.evictable_size())))
        self.moved(self.evict_moves())
        if insert_seq(self.t, ids) is None:
            return
        self.inserted.add(tuple(ids.tolist()))
        now = self.moved(INSERT_MOVES)
        for end in range(self.page_size, len(ids) + 1, self.page_size):
            assert now[tuple(ids[:end].tolist())] in ("device", "device+host")
        if ack:
            self.acknowledge()

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        ids = np.array(data.draw(st.sampled_from(sorted(self.inserted))), dtype=np.int32)
        cut = data.draw(st.integers(1, len(ids)))
        result = self.cache.match_prefix(ids[:cut])
        now = self.moved(set())
        aligned = cut // self.page_size * self.page_size
        on_device = [
            e
            for e in range(self.page_size, aligned + 1, self.page_size)
            if now.get(tuple(ids[:e].tolist())) in ("device", "device+host")
        ]
        assert result.prefix_len == (on_device[-1] if on_device else 0)
        on_host = [
            e
            for e in range(result.prefix_len + self.page_size, aligned + 1, self.page_size)
            if now.get(tuple(ids[:e].tolist())) == "host"
        ]
        assert result.host_hit_length == len(on_host) * self.page_size

    @rule(frac=st.floats(0, 1))
    def evict(self, frac: float) -> None:
        want = int(self.cache.evictable_size() * frac)
        before = self.t.allocator.available_size()
        result = self.cache.evict(EvictParams(want))
        assert result.num_tokens_evicted >= want
        assert self.t.allocator.available_size() - before == result.num_tokens_evicted
        self.moved(self.evict_moves())

    @rule(num_tokens=st.integers(0, 40))
    def evict_host(self, num_tokens: int) -> None:
        host_evictable = sum(n.key_len for n in self.cache.host_evictable_leaves())
        freed = self.cache.evict_host(num_tokens * self.page_size)
        assert freed >= min(num_tokens * self.page_size, host_evictable)
        self.moved(HOST_EVICT_MOVES)

    @precondition(lambda self: self.inserted)
    @rule(data=st.data(), use_quota=st.booleans(), evict_first=st.booleans())
    def load_back(self, data: st.DataObject, use_quota: bool, evict_first: bool) -> None:
        ids = np.array(data.draw(st.sampled_from(sorted(self.inserted))), dtype=np.int32)
        if evict_first:  # NOTE: demote all that can go, so that long host chains are common
            self.acknowledge()
            self.evict(1.0)
        match = self.cache.match_prefix(ids)
        quota = data.draw(st.integers(0, len(ids))) if use_quota else None
        loaded, last = self.cache.init_load_back(match.last_host_node, match.host_hit_length, quota)
        self.moved(self.evict_moves() | LOAD_MOVES)
        again = self.cache.match_prefix(ids)
        if len(loaded):
            assert len(loaded) == match.host_hit_length >= LOAD_BACK_MIN_TOKENS
            assert again.prefix_len == match.prefix_len + match.host_hit_length and last.lock_ref > 0
        elif match.host_hit_length >= LOAD_BACK_MIN_TOKENS and quota is None:  # NOTE: a quota shrinks by the lock
            assert self.t.allocator.available_size() < match.host_hit_length  # no room even after evicting

    @rule()
    def acknowledge(self) -> None:
        self.cache.writing_check()
        self.cache.loading_check()
        assert self.cache.num_in_flight() == 0
        self.moved(set())
        on_paths: dict[int, int] = {}  # NOTE: with nothing in flight, only the held locks protect
        for node, _ in self.locks:
            walker: Any = node
            while walker is not self.cache.root:
                on_paths[walker.id] = walker.key_len
                walker = walker.parent
        assert self.cache.protected_size() == sum(on_paths.values())

    @precondition(lambda self: self.inserted and len(self.locks) < 3)
    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        ids = np.array(data.draw(st.sampled_from(sorted(self.inserted))), dtype=np.int32)
        match = self.cache.match_prefix(ids)
        self.cache.inc_lock_ref(match.last_node)
        self.locks.append((match.last_node, tuple(ids[: match.prefix_len].tolist())))
        self.moved(set())

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)
        self.moved(set())

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def integrity_and_conservation(self) -> None:
        check_all(self.t)

    @invariant()
    def tiers_closed_and_from_inserted(self) -> None:
        ps = self.page_size
        prefixes = {s[:e] for s in self.inserted for e in range(ps, len(s) + 1, ps)}
        for prefix, tier in self.tiers.items():
            assert prefix in prefixes, prefix
            parent = self.tiers.get(prefix[:-ps]) if len(prefix) > ps else "device+host"
            assert parent is not None, prefix
            if tier != "host":
                assert parent != "host", (prefix, tier, parent)
            if self.policy != "write_back" and tier != "device":
                assert parent != "device", (prefix, tier, parent)

    @invariant()
    def in_flight_keeps_something_protected(self) -> None:
        if self.cache.num_in_flight():
            assert self.cache.protected_size() > 0

    @invariant()
    def every_tree_slot_holds_its_kv(self) -> None:
        for node, _, start in hi_walk(self.cache.root):
            if node is self.cache.root:
                continue
            for layer in range(NUM_LAYERS):
                k, v = encoded_kv(node.token_ids(), start, layer)
                if node.value is not None:
                    dk, dv = self.t.device_kv.get_kv_buffer(layer)
                    slots = torch.from_numpy(node.value)
                    assert torch.equal(dk[slots].cpu(), k) and torch.equal(dv[slots].cpu(), v), node
                if node.host_value is not None:
                    hk, hv = self.t.host_kv.get_kv_buffer(layer)
                    slots = torch.from_numpy(node.host_value)
                    assert torch.equal(hk[slots], k) and torch.equal(hv[slots], v), node


def machine_case(policy: str, page_size: int) -> Any:
    machine = type(f"HiRadix_{policy}_{page_size}", (HiRadixMachine,), {"policy": policy, "page_size": page_size})
    machine.TestCase.settings = settings(max_examples=50, stateful_step_count=50, deadline=None)
    return machine.TestCase


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_two_tier_cache_matches_the_model(policy: str, page_size: int) -> None:
    machine_case(policy, page_size)("runTest").runTest()
