"""The SGLang page census on hand-made pool views (the engine test runs it on SGLang's real pools):
every page exactly one of free / in the tree / in a live row; the leak + double free pair whose
counts cancel is named page by page."""

from __future__ import annotations

import pytest

from kvscope.probe.sglang_census import PageView, census_blocks, census_checks, take_page_census

TAKERS = {7: ("req-C", 9, "decode"), 2: ("req-A", 1, "alloc")}
RELEASERS = {1: ("bad-free", 10, "free")}


def test_a_pool_where_every_page_is_accounted_once_holds() -> None:
    view = PageView(4, 8, [5, 6, 7, 8], {1, 2}, {3: "req-D", 4: "req-D"})
    result = take_page_census("full", view, TAKERS, RELEASERS, {})
    assert result.ok and census_checks(3, [result])[0].ok
    check = census_checks(3, [result])[0]
    assert (check.total, check.available, check.evictable, check.held, check.uncached) == (32, 16, 8, 8, 0)


def test_a_leak_and_a_double_free_that_cancel_in_the_counts_are_both_named() -> None:
    """Page 7 is nowhere, page 1 is both free and in the tree: the free list has as many pages as if
    nothing were wrong (SGLang's count identity balances), the census names both."""
    view = PageView(4, 8, [1, 5, 6, 8], {1, 2}, {3: "req-D", 4: "req-D"})
    result = take_page_census("full", view, TAKERS, RELEASERS, {})
    assert (result.leaked, result.doubleref) == ([7], [1])
    check = census_checks(10, [result])[0]
    assert check.balanced and not check.ok
    assert check.violation == (
        "1 page leaked (in no free list, tree or live row): page 7 (slots 28-31) last taken by request req-C "
        "(decode at step 9) | 1 page freed while in use (a double free): page 1 free and in the tree; last "
        "released for request bad-free (free at step 10)"
    )


def test_a_page_twice_in_the_free_list_and_a_lock_left_by_a_finished_request() -> None:
    view = PageView(4, 4, [3, 4, 4], {1, 2}, {})
    result = take_page_census("full", view, {}, {}, {11: [("req-B", 4)]})
    assert result.doubleref == [4] and not result.leaked
    assert census_checks(5, [result])[0].violation == (
        "1 page freed while in use (a double free): page 4 twice in the free list; its releaser not recorded | 1 "
        "tree node still locked by finished requests: node 11 locked by request req-B at step 4"
    )


def test_request_rows_are_censused_as_pages_of_one() -> None:
    view = PageView(1, 4, [1, 2], set(), {3: "req-D"})
    result = take_page_census("req", view, {4: ("req-X", 2, "alloc")}, {}, {})
    assert census_checks(6, [result])[0].violation == (
        "1 row leaked (in no free list, tree or live row): row 4 last taken by request req-X (alloc at step 2)"
    )


def test_at_level_summary_stale_locked_pages_are_named_by_their_takers_and_a_double_free_by_its_taker() -> None:
    """Level summary keeps no lock ledger and no releasers: the pages under a lock no live holder
    accounts for (read from the tree's own counts) are named by who took them, grouped by taker; a
    double free names the page's taker and says who freed it is level full's to record."""
    view = PageView(4, 8, [1, 5, 6, 7, 8], {1, 2, 3}, {4: "req-D"})
    takers = {1: ("req-A", 1, "extend"), 2: ("req-A", 1, "extend"), 3: ("req-B", 4, "decode")}
    result = take_page_census("full", view, takers, {}, {}, {2, 3}, frees_seen=False)
    assert (result.stale_locked, result.doubleref, result.leaked) == ([2, 3], [1], [])
    assert not result.ok and result.as_json()["stale_locked"] == {"2": "req-A", "3": "req-B"}
    assert census_checks(7, [result])[0].violation == (
        "1 page freed while in use (a double free): page 1 free and in the tree; taken by request req-A (extend "
        "at step 1), who freed it is recorded at level full | 2 pages under a tree lock no live request or "
        "session holds (a lock never released; who locked it is recorded at level full): page 2 taken by request "
        "req-A (extend at step 1); page 3 taken by request req-B (decode at step 4)"
    )


@pytest.mark.parametrize(
    ("frees_seen", "unknown"), [(True, "its releaser not recorded"), (False, "who freed it is recorded at level full")]
)
def test_a_double_free_whose_free_was_not_seen_says_why_no_releaser_is_named(frees_seen: bool, unknown: str) -> None:
    """Hooked frees (level full) with no releaser for the page: the free was not recorded (before the
    probe, or dropped); frees not hooked (summary): level full records who freed it. Said with or
    without a taker."""
    view = PageView(4, 4, [1, 1, 3], {2}, {})  # NOTE: page 1 twice in the free list, page 4 leaked
    for takers, said in (
        ({1: ("req-A", 1, "extend")}, f"taken by request req-A (extend at step 1), {unknown}"),
        ({}, unknown),
    ):
        result = take_page_census("full", view, takers, {}, {}, frees_seen=frees_seen)
        assert f"page 1 twice in the free list; {said}" in census_checks(3, [result])[0].violation


def test_no_stale_locked_page_holds() -> None:
    view = PageView(4, 4, [3, 4], {1, 2}, {})
    assert take_page_census("full", view, {}, {}, {}, set()).ok
    assert take_page_census("full", view, {}, {}, {}, None).ok


def test_a_page_a_double_free_handed_out_again_is_named_with_both_holders() -> None:
    """Page 1 was freed while the tree held it and taken again by req-E: it is in no free list, so
    the sets balance; its owners do not (the tree and req-E's own row part). Page 5 is in two tree
    nodes, page 6 in the own parts of two rows. A row's tree prefix (page 2 in req-D's row) is the
    tree's, not a second owner."""
    live = {1: "req-E", 2: "req-D", 3: "req-D", 4: "req-F", 6: "req-D"}
    owned = ((1, "req-E"), (3, "req-D"), (6, "req-D"), (6, "req-F"), (4, "req-F"))
    view = PageView(4, 8, [7, 8], {1, 2, 5}, live, owned, frozenset({5}))
    releasers = {1: ("bad-free", 10, "free")}
    result = take_page_census("full", view, {}, releasers, {})
    assert (result.leaked, result.doubleref) == ([], [])
    assert result.twice == {1: ["the tree", "req-E"], 5: ["the tree", "the tree"], 6: ["req-D", "req-F"]}
    assert not result.ok
    assert census_checks(12, [result])[0].violation == (
        "3 pages held twice (a double free handed out a page still in use): page 1 in the tree and request "
        "req-E's row; last released for request bad-free (free at step 10); page 5 in 2 tree nodes; page 6 in "
        "request req-D's row and request req-F's row"
    )


def test_a_row_prefix_shared_with_the_tree_holds() -> None:
    view = PageView(4, 4, [4], {1, 2}, {1: "req-D", 2: "req-D", 3: "req-D"}, ((3, "req-D"),))
    assert take_page_census("full", view, {}, {}, {}).ok


def test_a_page_id_outside_the_pool_in_the_free_list_is_named_not_counted() -> None:
    """SGLang's padding page 0 in the free list: flagged; the pool's counts stay its own 4 pages."""
    view = PageView(4, 4, [0, 3, 4], {1, 2}, {})
    result = take_page_census("full", view, {}, {}, {})
    check = census_checks(2, [result])[0]
    assert result.outside == [0] and (check.total, check.available) == (16, 8)
    assert check.violation == "1 page id outside 1..4 in the free list: 0"


def test_the_padding_page_handed_out_to_a_row_and_the_tree_is_named_with_its_releaser_not_counted() -> None:
    """Page 0 in use (a free that read a cleared SWA mapping put it in the free list, an alloc handed it
    out): named with its holders, who took it and the free that put it there; the counts stay the
    pool's own 4 pages (the live row's page 0 counted as held made the totals 5 pages, and read clean)."""
    view = PageView(4, 4, [2, 3], {0, 1}, {0: "req-D", 4: "req-D"})
    takers = {0: ("req-D", 9, "extend")}
    result = take_page_census("swa", view, takers, {0: ("req-C", 8, "free")}, {})
    check = census_checks(10, [result])[0]
    assert result.stray == {0: ["the tree", "req-D"]} and not result.ok
    assert (check.total, check.available, check.evictable, check.held) == (16, 8, 4, 4)
    assert check.violation == (
        "1 page id outside 1..4 in use (handed out from the free list): page 0 in the tree and request req-D's row, "
        "taken by request req-D (extend at step 9); last released for request req-C (free at step 8)"
    )
    (block,) = census_blocks(10, [result])
    assert (block.term, block.block, block.ref, block.taker, block.releaser) == (
        "s.stray",
        0,
        2,
        ("req-D", 9, "extend"),
        ("req-C", 8, "free"),
    )


def test_a_double_free_by_no_requests_call_says_the_releaser_is_unknown_and_why() -> None:
    view = PageView(4, 4, [1, 3, 4], {1, 2}, {})
    group = take_page_census("full", view, {}, {1: (None, 7, "group")}, {})
    assert census_checks(8, [group])[0].violation == (
        "1 page freed while in use (a double free): page 1 free and in the tree; last released by a batch's free "
        "group at step 7 (request unknown: a group frees several at once)"
    )
    stray = take_page_census("full", view, {}, {1: (None, 7, "free")}, {11: [(None, 3)]})
    assert census_checks(8, [stray])[0].violation == (
        "1 page freed while in use (a double free): page 1 free and in the tree; last released at step 7 outside "
        "any request's call (request unknown) | 1 tree node still locked by finished requests: node 11 locked by "
        "an unknown request at step 3 (locked outside any request's call)"
    )


def test_every_page_each_pool_names_is_a_census_block_under_its_pools_term() -> None:
    """More pages than a message names (8), a double free, a page held twice, an id outside the pool, and a
    leaked request row: one row each, the pool's tag on the term, the taker or releaser the ledger holds."""
    leaked = list(range(3, 14))  # 11 pages in nothing
    view = PageView(4, 16, [0, 1, 14, 15], {1, 2, 16}, {}, owned=((16, "req-D"),))
    takers = {p: ("req-C", 9, "alloc") for p in leaked}
    full = take_page_census("full", view, takers, {1: ("bad-free", 10, "free")}, {})
    rows = take_page_census("req", PageView(1, 4, [1, 2], set(), {3: "req-D"}), {4: ("req-X", 2, "alloc")}, {}, {})
    checks = census_checks(12, [full, rows], "busy")
    assert [c.census for c in checks] == ["busy", "busy"] and "(+3 more)" in (checks[0].violation or "")
    blocks = census_blocks(12, [full, rows])
    assert [(b.term, b.block) for b in blocks] == [
        *(("leaked", p) for p in leaked),
        ("double", 1),
        ("twice", 16),
        ("beyond", 0),
        ("r.leaked", 4),
    ]
    assert all(b.step == 12 and len(b.term) <= 8 for b in blocks)
    assert {b.taker for b in blocks[: len(leaked)]} == {("req-C", 9, "alloc")}
    assert blocks[len(leaked)].releaser == ("bad-free", 10, "free")
    assert (blocks[len(leaked) + 1].ref, blocks[len(leaked) + 1].accounted) == (2, 1)  # the tree and req-D's row
    assert blocks[-1].taker == ("req-X", 2, "alloc")


def test_a_census_that_holds_names_no_page() -> None:
    view = PageView(4, 8, [5, 6, 7, 8], {1, 2}, {3: "req-D", 4: "req-D"})
    assert census_blocks(3, [take_page_census("full", view, TAKERS, RELEASERS, {})]) == []
