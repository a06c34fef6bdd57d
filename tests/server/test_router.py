"""The data-parallel router without processes: its held-page index, fed the PagesOut deltas of
real radix caches (CachedPages, as each rank's scheduler sends them), gives each rank's cached
tokens for a prompt as that rank's own cache matches them; prefix_affinity routes to the rank
holding the prompt and records what it saw; a dead rank is never chosen; loads come from stats."""

from __future__ import annotations

import random

import pytest

from kvscope.fleet.dispatch import DispatchError
from kvscope.server.kv_events import prompt_page_hashes
from kvscope.server.protocol import PagesOut, PoolStats, RouteInfo, StatsOut
from kvscope.server.router import Router

PAGE_SIZE = 4


def stats(num_requests: int, used_tokens: int = 0) -> StatsOut:
    pool = PoolStats(total=256, used=used_tokens, available=256 - used_tokens, evictable=0, protected=0)
    return StatsOut(1, {"full": pool}, num_requests, 0, 0, 0, 0, 0, 0, 0, 0)


def test_each_ranks_cached_tokens_are_what_its_own_radix_cache_matches() -> None:
    from kvscope.cache import EvictParams, RadixCache
    from kvscope.mem import make_token_allocator
    from kvscope.server.kv_events import CachedPages, page_deltas
    from tests.cache.helpers import alloc_extend, ids

    allocators = [make_token_allocator(64, PAGE_SIZE, "cpu", strict=True) for _ in range(2)]
    caches = [RadixCache(allocator, PAGE_SIZE, strict=True) for allocator in allocators]
    pages = [CachedPages(cache, PAGE_SIZE) for cache in caches]
    router = Router("prefix_affinity", num_ranks=2, page_size=PAGE_SIZE)
    rng = random.Random(5)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]

    def prompt(num_tokens_after: int) -> list[int]:
        return prefixes[rng.randrange(3)] + [rng.randrange(50) for _ in range(num_tokens_after)]

    num_removed, inserted = 0, []
    for _ in range(60):
        rank, seq = rng.randrange(2), prompt(PAGE_SIZE * rng.randrange(1, 4))  # whole pages
        allocator, cache = allocators[rank], caches[rank]
        if allocator.available_size() < len(seq):
            cache.evict(EvictParams(min(len(seq) - allocator.available_size(), cache.evictable_size())))
        slots = alloc_extend(allocator, 0, len(seq), -1)
        assert slots is not None
        allocator.free(slots[: cache.insert(ids(*seq), slots)])
        inserted.append(seq)
        stored, removed = page_deltas(pages[rank].diff())
        router.took_pages(rank, PagesOut(stored, removed))
        num_removed += len(removed)
        for probe in (*rng.sample(inserted, min(len(inserted), 4)), prompt(rng.randrange(12))):  # evicted ones too
            matched = [cache.match_prefix(ids(*probe)).prefix_len for cache in caches]
            assert router.cached_tokens(probe) == matched, probe
    assert num_removed > 0, "the small pools evicted: the index must have dropped pages"


def test_prefix_affinity_routes_to_the_rank_holding_the_prompt_and_records_what_it_saw() -> None:
    router = Router("prefix_affinity", num_ranks=3, page_size=PAGE_SIZE)
    prompt = list(range(20))
    hashes = prompt_page_hashes(prompt, PAGE_SIZE)
    router.took_pages(0, PagesOut(stored=hashes[:1], removed=[]))
    router.took_pages(2, PagesOut(stored=hashes[:3], removed=[]))
    assert router.choose(prompt) == (2, RouteInfo("prefix_affinity", 12, 4))
    router.took_pages(2, PagesOut(stored=[], removed=hashes[1:2]))  # a gap ends the held prefix
    assert router.cached_tokens(prompt) == [4, 0, 4]


def test_a_rank_that_does_not_answer_is_skipped_until_it_answers_again() -> None:
    router = Router("round_robin", num_ranks=2, page_size=PAGE_SIZE)
    router.replicas[1].answering = False
    assert [router.choose([7] * 8)[0] for _ in range(3)] == [0, 0, 0]
    assert router.live_ranks() == [0, 1] and router.answering_ranks() == [0] and router.silent_ranks() == [1]
    router.replicas[0].answering = False
    with pytest.raises(DispatchError):
        router.choose([7] * 8)
    router.replicas[1].answering = True
    assert router.choose([7] * 8)[0] == 1 and router.dead_ranks() == []


def test_a_dead_rank_is_never_chosen_and_none_live_is_a_dispatch_error() -> None:
    router = Router("round_robin", num_ranks=3, page_size=PAGE_SIZE)
    router.rank_exited(1)
    assert [router.choose([7] * 8)[0] for _ in range(4)] == [0, 2, 0, 2]
    assert router.live_ranks() == [0, 2] and router.dead_ranks() == [1]
    affinity = Router("prefix_affinity", num_ranks=2, page_size=PAGE_SIZE)
    prompt = list(range(8))
    affinity.took_pages(0, PagesOut(stored=prompt_page_hashes(prompt, PAGE_SIZE), removed=[]))
    affinity.rank_exited(0)
    rank, route = affinity.choose(prompt)
    assert rank == 1  # rank 0 holds the whole prompt, but it is gone
    assert route is not None and route.elsewhere_cached_tokens == 0  # and so is its cache: no routing loss
    assert affinity.cached_tokens(prompt) == [0, 0]
    affinity.rank_exited(1)
    with pytest.raises(DispatchError):
        affinity.choose(prompt)


def test_loads_come_from_each_ranks_stats_and_ready_waits_for_every_rank() -> None:
    router = Router("total_requests", num_ranks=2, page_size=PAGE_SIZE)
    router.took_stats(0, stats(num_requests=5))
    assert not router.all_reported
    router.took_stats(1, stats(num_requests=6))
    assert router.all_reported
    assert router.choose([1, 2, 3])[0] == 0
    assert router.choose([1, 2, 3])[0] == 0  # 6 against 6: the lower rank
    assert router.choose([1, 2, 3])[0] == 1
    router.finished(1, 3)
    router.finished(1, 3)
    assert router.choose([1, 2, 3])[0] == 1  # 7 against 5 once two of rank 1's ended


def test_one_rank_takes_everything_and_records_no_routing() -> None:
    router = Router("prefix_affinity", num_ranks=1, page_size=PAGE_SIZE)
    assert router.choose(list(range(8))) == (0, None)
