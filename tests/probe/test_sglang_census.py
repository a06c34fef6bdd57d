"""The SGLang page census on hand-made pool views (the engine test runs it on SGLang's real pools):
every page exactly one of free / in the tree / in a live row; the leak + double free pair whose
counts cancel is named page by page."""

from __future__ import annotations

from kvscope.probe.sglang_census import PageView, census_checks, take_page_census

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
        "1 page freed while in use (a double free): page 4 twice in the free list | 1 tree node still locked by "
        "finished requests: node 11 locked by request req-B at step 4"
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
    double free names the page's taker and says its releaser was not recorded."""
    view = PageView(4, 8, [1, 5, 6, 7, 8], {1, 2, 3}, {4: "req-D"})
    takers = {1: ("req-A", 1, "extend"), 2: ("req-A", 1, "extend"), 3: ("req-B", 4, "decode")}
    result = take_page_census("full", view, takers, {}, {}, {2, 3})
    assert (result.stale_locked, result.doubleref, result.leaked) == ([2, 3], [1], [])
    assert not result.ok and result.as_json()["stale_locked"] == {"2": "req-A", "3": "req-B"}
    assert census_checks(7, [result])[0].violation == (
        "1 page freed while in use (a double free): page 1 free and in the tree; taken by request req-A (extend "
        "at step 1), its releaser not recorded | 2 pages under a tree lock no live request or session holds (a "
        "lock never released; who locked it is recorded at level full): page 2 taken by request req-A (extend at step "
        "1); page 3 taken by request req-B (decode at step 4)"
    )


def test_no_stale_locked_page_holds() -> None:
    view = PageView(4, 4, [3, 4], {1, 2}, {})
    assert take_page_census("full", view, {}, {}, {}, set()).ok
    assert take_page_census("full", view, {}, {}, {}, None).ok
