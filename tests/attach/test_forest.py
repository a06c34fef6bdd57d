"""PageForest against a plain dict of page -> tiers over random store / remove / clear batches
(coalesced stores, two tiers, removes of pages never seen, other attention groups), with its
integrity check after every batch; tier moves (HiCache demotion and load-back) and a late
joiner's unknown roots by hand; and end to end: kvscope's RadixCache, diffed into SGLang-format
events by CachedPages, published by KVEventPublisher and read by EventSubscriber, rebuilds
into a forest equal to the cache's pages, page for page, at every quiet point."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvscope.attach.forest import PageForest
from kvscope.attach.subscriber import EventSubscriber
from kvscope.attach.wire import TIERS, Batch, Cleared, Removed, Stored, WireEvent, block_key
from tests.attach.test_subscriber import TOPIC, Served, drain, short_dir  # noqa: F401 - fixture

BLOCK_SIZE = 2
MAX_DEPTH = 4
Path_ = tuple[int, ...]
PATHS: list[Path_] = [
    p for depth in range(1, MAX_DEPTH + 1) for p in [tuple((i >> k) & 1 for k in range(depth)) for i in range(2**depth)]
]
RANK = {tier: rank for rank, tier in enumerate(TIERS)}


def page_hash(path: Path_) -> int:
    """An unsigned 64-bit hash per path (half of them >= 2**63, as vLLM's are)."""
    return int.from_bytes(hashlib.sha256(repr(path).encode()).digest()[:8], "big")


def page_tokens(path: Path_) -> tuple[int, ...]:
    return (len(path), sum(bit << i for i, bit in enumerate(path)))


def stored(start: Path_, more: list[int], tier: str, group: int = 0) -> Stored:
    """A coalesced store: the page at `start` and a chain below it."""
    chain = [start]
    for bit in more:
        if len(chain[-1]) < MAX_DEPTH:
            chain.append((*chain[-1], bit))
    parent = page_hash(start[:-1]) if len(start) > 1 else None
    return Stored(
        tuple(page_hash(p) for p in chain),
        parent,
        tuple(t for p in chain for t in page_tokens(p)),
        BLOCK_SIZE,
        tier,
        group,
    )


TIER = st.sampled_from(("device", "host"))
GROUP = st.sampled_from((0, 0, 0, 1))
EVENT: st.SearchStrategy[WireEvent] = st.one_of(
    st.builds(stored, st.sampled_from(PATHS), st.lists(st.integers(0, 1), max_size=3), TIER, GROUP),
    st.builds(
        lambda paths, tier, group: Removed(tuple(page_hash(p) for p in paths), tier, group),
        st.lists(st.sampled_from(PATHS), min_size=1, max_size=4),
        TIER,
        GROUP,
    ),
    st.just(Cleared()),
)


class Reference:
    """The forest's rules on a flat dict: page -> (parent, tokens, tiers)."""

    def __init__(self) -> None:
        self.pages: dict[int, tuple[int | None, tuple[int, ...], set[str]]] = {}
        self.stored: Counter[str] = Counter()
        self.removed: Counter[str] = Counter()
        self.moves: Counter[tuple[str, str]] = Counter()
        self.unknown_removes = self.resets = self.ignored = 0

    def apply(self, event: WireEvent) -> None:
        if isinstance(event, Cleared):
            self.pages.clear()
            self.resets += 1
        elif event.group:
            self.ignored += 1
        elif isinstance(event, Stored):
            for block, parent, tokens in event.pages():
                tiers = self.pages.setdefault(block, (parent, tokens, set()))[2]
                if event.tier in tiers:
                    continue
                if tiers and all(RANK[event.tier] < RANK[t] for t in tiers):
                    self.moves[(min(tiers, key=RANK.__getitem__), event.tier)] += 1
                tiers.add(event.tier)
                self.stored[event.tier] += 1
        else:
            for block in event.block_hashes:
                if block not in self.pages or event.tier not in self.pages[block][2]:
                    self.unknown_removes += 1
                    continue
                tiers = self.pages[block][2]
                tiers.remove(event.tier)
                self.removed[event.tier] += 1
                if not tiers:
                    del self.pages[block]
                elif all(RANK[event.tier] < RANK[t] for t in tiers):
                    self.moves[(event.tier, min(tiers, key=RANK.__getitem__))] += 1

    def depth_tokens(self, block: int) -> int:
        depth = 0
        node: int | None = block
        while node in self.pages:
            depth += len(self.pages[node][1])
            node = self.pages[node][0]
        return depth


class ForestMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.forest = PageForest()
        self.ref = Reference()
        self.ts = 0.0

    @rule(events=st.lists(EVENT, min_size=1, max_size=4))
    def apply_batch(self, events: list[WireEvent]) -> None:
        self.ts += 1.0
        self.forest.apply(Batch(self.ts, tuple(events), 0))
        for event in events:
            self.ref.apply(event)

    @invariant()
    def matches_the_reference(self) -> None:
        forest, ref = self.forest, self.ref
        forest.check_integrity()
        assert {h: (p.parent_hash, p.token_ids, p.tiers) for h, p in forest.pages.items()} == ref.pages
        for tier in TIERS:
            counts = forest.tiers[tier]
            live = [tokens for _, tokens, tiers in ref.pages.values() if tier in tiers]
            assert (counts.num_pages, counts.num_tokens) == (len(live), sum(map(len, live)))
            assert (counts.num_stored_pages, counts.num_removed_pages) == (ref.stored[tier], ref.removed[tier])
            assert counts.num_removed_tokens == BLOCK_SIZE * ref.removed[tier]
        assert forest.moves == ref.moves
        assert (forest.unknown_removes, forest.resets, forest.ignored_events) == (
            ref.unknown_removes,
            ref.resets,
            ref.ignored,
        )
        assert forest.num_orphans == sum(
            1 for parent, _, _ in ref.pages.values() if parent is not None and parent not in ref.pages
        )

    @invariant()
    def the_snapshot_lists_every_page_after_its_parent(self) -> None:
        rows = self.forest.snapshot()
        assert sorted(row.page_hash for row in rows) == sorted(self.ref.pages)
        seen: set[int] = set()
        for row in rows:
            parent, tokens, tiers = self.ref.pages[row.page_hash]
            assert row.orphan == (parent is not None and parent not in self.ref.pages)
            assert row.orphan or parent is None or parent in seen
            assert row.depth_tokens == self.ref.depth_tokens(row.page_hash)
            assert set(row.tiers) == tiers and row.token_preview == tokens[:8]
            seen.add(row.page_hash)


TestForestAgainstADict = ForestMachine.TestCase
TestForestAgainstADict.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_page_demoted_to_the_host_and_loaded_back_counts_both_moves() -> None:
    forest = PageForest()
    page = stored((0,), [1], "device")
    forest.apply(Batch(1.0, (page,), None))
    forest.apply(Batch(2.0, (stored((0,), [1], "host"),), None))  # a backup: a copy, no move
    assert not forest.moves and forest.counts()["host"].num_pages == 2
    forest.apply(Batch(3.0, (Removed(page.block_hashes, "device"),), None))  # evicted from the device
    assert forest.demoted == 2 and forest.moves[("device", "host")] == 2
    assert forest.counts()["device"].num_pages == 0 and len(forest.pages) == 2
    forest.apply(Batch(4.0, (stored((0,), [], "device"),), None))  # the first page is loaded back
    assert forest.loaded_back == 1 and forest.moves[("host", "device")] == 1
    assert forest.counts()["device"].num_removed_pages == 2 and forest.counts()["device"].num_stored_pages == 3
    forest.check_integrity()


def test_a_late_joiner_sees_unknown_roots_and_unknown_removes() -> None:
    forest = PageForest()
    forest.apply(Batch(1.0, (stored((1, 0), [1], "device"), Removed((page_hash((0,)),), "device")), None))
    assert forest.unknown_removes == 1 and forest.num_orphans == 1
    assert forest.roots() == [page_hash((1, 0))]
    first, second = forest.snapshot()
    assert first.orphan and first.depth_tokens == BLOCK_SIZE and second.depth_tokens == 2 * BLOCK_SIZE
    forest.apply(Batch(2.0, (stored((1,), [], "device"),), None))  # its parent shows up after all
    assert forest.num_orphans == 0 and forest.roots() == [page_hash((1,))]
    assert forest.prefix_tokens(page_hash((1, 0, 1))) == [
        *page_tokens((1,)),
        *page_tokens((1, 0)),
        *page_tokens((1, 0, 1)),
    ]
    forest.apply(Batch(3.0, (Cleared(),), None))
    assert forest.resets == 1 and not forest.pages and forest.counts()["device"].num_tokens == 0
    forest.check_integrity()


def test_the_integrity_check_catches_a_counter_that_drifted() -> None:
    forest = PageForest()
    forest.apply(Batch(1.0, (stored((0,), [0, 1], "device"),), None))
    forest.tiers["device"].num_tokens += 1
    with pytest.raises(AssertionError, match="device: counted 3 pages / 7 tokens, recount 3 / 6"):
        forest.check_integrity()


# -- end to end: kvscope's radix cache -> its publisher -> the subscriber -> the forest ----------------


def test_the_forest_equals_the_radix_caches_pages_at_quiet_points(short_dir: Path) -> None:  # noqa: F811
    import torch  # noqa: F401 - the cache side only; kvscope.attach itself never imports it

    from kvscope.cache import EvictParams, RadixCache
    from kvscope.mem import make_token_allocator
    from kvscope.server.kv_events import AllBlocksCleared, CachedPages, KVEventsConfig
    from tests.cache.helpers import alloc_extend, ids

    page_size = 4
    allocator = make_token_allocator(96, page_size, "cpu", strict=True)
    cache = RadixCache(allocator, page_size, strict=True)
    pages = CachedPages(cache, page_size)
    config = KVEventsConfig(
        publisher="zmq", endpoint=f"ipc://{short_dir}/kv", replay_endpoint=f"ipc://{short_dir}/rp", topic=TOPIC
    )
    served = Served(config)
    served.publish([AllBlocksCleared()])  # as `kvscope serve` starts its stream
    subscriber = EventSubscriber(config.endpoint, replay_endpoint=config.replay_endpoint, topic=TOPIC)
    forest = PageForest()
    rng = random.Random(17)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    assert subscriber.catch_up() == 1
    try:
        for step in range(40):
            seq = prefixes[rng.randrange(3)] + [rng.randrange(50) for _ in range(4 * rng.randrange(1, 4))]
            if allocator.available_size() < len(seq):
                cache.evict(EvictParams(min(len(seq) - allocator.available_size(), cache.evictable_size())))
            slots = alloc_extend(allocator, 0, len(seq), -1)
            assert slots is not None
            allocator.free(slots[: cache.insert(ids(*seq), slots)])  # the tree already held that prefix
            served.publish(pages.diff())
            if step % 5 == 4:  # a quiet point: everything published has arrived
                missing = served.publisher.seq - forest.num_batches
                for frame in drain(subscriber, lambda got: len(got) >= missing):  # noqa: B023 - used at once
                    forest.apply(frame.batch)
                expected = {
                    block_key(h): (
                        None if p.parent_hash is None else block_key(p.parent_hash),
                        tuple(memoryview(p.token_bytes).cast("i")),
                        {"device"},
                    )
                    for h, p in pages.pages.items()
                }
                assert {h: (p.parent_hash, p.token_ids, p.tiers) for h, p in forest.pages.items()} == expected
                forest.check_integrity()
                assert forest.num_orphans == 0 and forest.unknown_removes == 0
    finally:
        subscriber.close()
        served.close()
    device = forest.counts()["device"]
    assert device.num_removed_pages > 0, "the small pool evicted: pages must leave"
    assert device.num_stored_pages - device.num_removed_pages == device.num_pages == len(pages.pages)
    assert device.num_tokens == page_size * len(pages.pages) and forest.resets == 1
    assert subscriber.lost_batches == 0
