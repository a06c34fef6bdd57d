"""The block census (kvscope/probe/census.py) on plain blocks: the lingered term, the culprit rules
(a request is named only for what the probe saw its call do), and the pool's two views (a dict of
ref counts, vLLM's array by block id) giving the same census. vllm_views' free-queue walk stops on
links corrupted into a cycle."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvscope.probe import BlockView, census_checks, take_census
from kvscope.probe.census import TERMS
from kvscope.probe.vllm_views import free_list


def block(block_id: int) -> SimpleNamespace:
    return SimpleNamespace(block_id=block_id, is_null=False)


def pool(refs: dict[int, int], queued: list[int]) -> BlockView:
    return BlockView(refs, set(), queued, len(queued))


def test_blocks_held_only_by_requests_lingering_past_the_bounds_are_lingered_and_named() -> None:
    refs = {1: 1, 2: 2, 3: 1, 4: 0}
    tables = [{"live": [block(2)], "done": [block(1), block(2)], "young": [block(3)]}]
    result = take_census(pool(refs, [4]), tables, [], {"live", "done", "young"}, {}, lingering={"done": 7})
    assert result.lingered == {1: ("done",)}  # block 2 is also a live request's; "young" is within the bounds
    assert not result.ok and not result.leaked and not result.lostref
    message = next(c for c in census_checks(9, result, "busy") if c.pool == "lingered").message()
    assert "1 block held only by requests that ended and linger past the bounds" in message
    assert "block 1 held by done (ended at step 7)" in message
    within = take_census(pool(refs, [4]), tables, [], {"live", "done", "young"}, {})
    assert within.ok and within.lingered == {}


def test_a_hit_without_a_reference_is_blamed_on_the_request_that_hit_not_on_the_last_releaser() -> None:
    tables = [{"first": [block(1)], "hit": [block(1)]}]
    result = take_census(
        pool({1: 1}, []),
        tables,
        [],
        {"first", "hit"},
        {},
        {1: ("innocent", 3, "free")},
        unpinned={1: ("hit", 4)},
    )
    check = next(c for c in census_checks(5, result) if c.pool == "lostref")
    assert "block 1 ref 1, accounted 2; culprit request hit: its prefix hit at step 4" in check.message()
    assert "innocent" not in check.message()


def test_a_release_too_many_states_the_last_release_and_leaves_the_culprit_unknown() -> None:
    result = take_census(pool({1: -1, 2: 0}, [1, 2]), [], [], set(), {}, {1: (None, 3, "free")})
    text = next(c for c in census_checks(5, result) if c.pool == "lostref").message()
    assert "block 1 ref -1, accounted 0; last released outside any request's call (free at step 3)" in text
    assert "culprit unknown" in text and "culprit request" not in text
    leaked = take_census(pool({1: 1}, []), [], [], set(), {1: ("r1", 2, "touch")})
    text = next(c for c in census_checks(5, leaked) if c.pool == "leaked").message()
    assert "block 1 ref 1, accounted 0; last taken by request r1 (touch at step 2); culprit unknown" in text


def test_a_negative_count_out_of_the_free_queue_fails_lostref_alone_and_every_row_balances() -> None:
    """A double free can leave a block at ref -1 outside the free queue (vLLM handed it out and freed
    it again): it is held, named by lostref, and the pool's counts still add up on every row (it was
    in no bucket: every term's row read '1 tokens missing')."""
    tables = [{"r1": [block(1)]}]
    result = take_census(pool({1: -1, 3: 0}, [3]), tables, [], {"r1"}, {})
    checks = census_checks(5, result)
    assert all(c.balanced for c in checks), [c.message() for c in checks]
    assert [c.pool for c in checks if not c.ok] == ["lostref"]
    assert result.lostref == {1: (-1, 1)}


def test_every_check_row_says_which_census_it_belongs_to() -> None:
    result = take_census(pool({1: 0}, [1]), [], [], set(), {})
    checks = census_checks(3, result, "drain")
    assert [c.pool for c in checks] == list(TERMS) and {c.census for c in checks} == {"drain"}


def test_vllms_array_of_ref_counts_gives_the_census_of_the_same_pool_as_a_dict() -> None:
    refs = {1: 0, 2: 2, 3: 1, 4: -1, 5: 0}
    tables = [{"a": [block(2), block(3)], "b": [block(2), block(4)]}]
    array = np.array([0, *refs.values()], dtype=np.int64)  # NOTE: index 0 is vLLM's null block
    by_dict = take_census(BlockView(refs, {1}, [1, 4], 3), tables, [[block(5)]], {"a"}, {})
    by_array = take_census(BlockView(array, {1}, [1, 4], 3), tables, [[block(5)]], {"a"}, {})
    assert by_dict == by_array
    assert by_dict.lostref == {4: (-1, 1), 5: (0, 1)} and by_dict.qheld == [] and by_dict.unqueued == [5]
    assert by_dict.orphans == ["b"] and by_dict.qcount == 1 and by_dict.num_cached_free == 1


def test_a_free_queue_whose_links_form_a_cycle_is_walked_once_and_stops() -> None:
    head, tail = SimpleNamespace(), SimpleNamespace()
    a, b = SimpleNamespace(block_id=1), SimpleNamespace(block_id=2)
    head.next_free_block, a.next_free_block, b.next_free_block = a, b, a  # NOTE: b links back to a
    queue = SimpleNamespace(fake_free_list_head=head, fake_free_list_tail=tail)
    assert len(free_list(queue, 4)) == 5
    b.next_free_block = tail
    assert [x.block_id for x in free_list(queue, 4)] == [1, 2]
