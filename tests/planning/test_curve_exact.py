"""The one-pass curve against the model it implements and against brute-force replays through
the real RadixCache: exact, request by request, at every tested capacity (page sizes 1 and 16,
several seeds, capacities from zero pages to past the footprint); the slot convention lies
between two points of the curve; SGLang's whole-leaf eviction departs from it (the gap is
printed, run with -s to see it)."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.planning import ReplayConfig, ReplayRequest, one_pass_curve, replay
from tests.planning.helpers import capacities_for, ceil_pages, random_trace, reference_hits

SEEDS = range(5)
PAGE_SIZES = [1, 16]


def test_a_split_does_not_refresh_the_unmatched_piece_in_page_mode() -> None:
    """Page-granular eviction keeps the unmatched lower piece of a split node at its old access
    time (SGLang's leaf mode stamps it): [3 4] is not younger than [5 6], so [3 4] goes first."""
    requests = [
        ReplayRequest("a", np.array([1, 2], dtype=np.int32), np.array([1, 2, 3, 4], dtype=np.int32)),
        ReplayRequest("b", np.array([5], dtype=np.int32), np.array([5, 6], dtype=np.int32)),
        ReplayRequest("c", np.array([1, 2, 9], dtype=np.int32), np.array([1, 2, 9, 8], dtype=np.int32)),
        ReplayRequest("d", np.array([5, 6, 7], dtype=np.int32), np.array([5, 6, 7, 7], dtype=np.int32)),
    ]
    hits = replay(requests, ReplayConfig(6, 1, "page", "tree")).request_hit_tokens.tolist()
    assert hits == [0, 0, 2, 2]
    assert one_pass_curve(requests).request_hit_tokens(6).tolist() == [0, 0, 2, 2]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_one_pass_equals_the_page_level_lru_model(seed: int, page_size: int) -> None:
    requests = random_trace(seed, 40, page_size)
    curve = one_pass_curve(requests, page_size)
    capacities = capacities_for(requests, page_size)
    expected = reference_hits(requests, capacities, page_size)
    for k in capacities:
        assert curve.request_hit_tokens(k).tolist() == expected[k], f"capacity {k}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_one_pass_equals_page_granular_replays(seed: int, page_size: int) -> None:
    """Tree convention: the tree holds at most K tokens between requests (see curve.py)."""
    requests = random_trace(seed, 40, page_size)
    curve = one_pass_curve(requests, page_size)
    for k in capacities_for(requests, page_size):
        result = replay(requests, ReplayConfig(k, page_size, "page", "tree"))
        assert result.num_skipped == 0
        mismatched = np.flatnonzero(result.request_hit_tokens != curve.request_hit_tokens(k))
        assert not len(mismatched), (
            f"capacity {k}: {len(mismatched)} requests differ, first #{mismatched[0]}: replay "
            f"{result.request_hit_tokens[mismatched[0]]} vs curve {curve.request_hit_tokens(k)[mismatched[0]]}"
        )
        assert result.num_hit_tokens == curve.hit_tokens(k)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_slot_convention_replays_lie_between_two_points_of_the_curve(seed: int, page_size: int) -> None:
    """A pool of C slots shared with the request in flight holds between C - L and C tree tokens
    when a request arrives (L: the longest request in whole pages), so each request's hits lie
    between the curve at those two capacities."""
    requests = random_trace(seed, 40, page_size)
    curve = one_pass_curve(requests, page_size)
    longest = max(ceil_pages(r.seq_len, page_size) for r in requests)
    for k in capacities_for(requests, page_size)[1:]:
        hits = np.maximum(replay(requests, ReplayConfig(k, page_size, "page", "slots")).request_hit_tokens, 0)
        low, high = curve.request_hit_tokens(max(k - longest, 0)), curve.request_hit_tokens(k)
        assert np.all(low <= hits) and np.all(hits <= high), f"capacity {k}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_whole_leaf_eviction_departs_from_the_curve(page_size: int) -> None:
    """SGLang's default: whole leaves, possibly more than needed. Report the gap, and prove the
    comparison can see a difference at all."""
    errors, worst = [], 0.0
    for seed in SEEDS:
        requests = random_trace(seed, 40, page_size)
        curve = one_pass_curve(requests, page_size)
        for k in capacities_for(requests, page_size)[1:]:
            leaf = replay(requests, ReplayConfig(k, page_size, "leaf", "tree"))
            gap = abs(leaf.hit_rate - curve.hit_rate(k))
            errors.append(gap)
            worst = max(worst, gap)
    print(
        f"\nwhole-leaf eviction vs one-pass curve, page size {page_size}: mean absolute hit-rate gap "
        f"{np.mean(errors):.4f}, worst {worst:.4f}, over {len(errors)} (trace, capacity) cases"
    )
    assert worst > 0, "whole-leaf eviction never differed: the traces do not exercise eviction"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_curve_totals_agree_with_per_request_hits(page_size: int) -> None:
    requests = random_trace(7, 60, page_size)
    curve = one_pass_curve(requests, page_size)
    grid = np.arange(0, curve.working_set_tokens + 3 * page_size)
    totals = curve.hit_tokens(grid)
    assert totals[0] == 0 and np.all(np.diff(totals) >= 0), "hits must grow with capacity from 0"
    for k in grid[:: max(1, len(grid) // 25)]:
        assert curve.request_hit_tokens(int(k)).sum() == totals[k] == curve.hit_tokens(int(k))
    assert totals[-1] == curve.max_hit_tokens == curve.hit_tokens(curve.saturation_tokens)
    assert curve.hit_tokens(curve.saturation_tokens - 1) < curve.max_hit_tokens or curve.saturation_tokens == 0
    assert curve.hit_tokens(page_size * 5 + page_size - 1) == curve.hit_tokens(page_size * 5)  # floored to pages
    capacities, hits = curve.breakpoints()
    assert np.array_equal(hits, curve.hit_tokens(capacities)) and capacities[-1] == curve.saturation_tokens
    assert 0 < curve.max_hit_rate < 1 and curve.num_prompt_tokens == sum(r.prompt_len for r in requests)
