"""The page census of an SGLang pool at an idle point: every page is exactly one of free (in the
allocator's free list), in the tree (a radix node's value), or in a live request's row. Engine-neutral
values in, leak checks out (the SGLang module reads the pools into a PageView).

NOTE: the terms (one leak check per pool, pool = its name: full, swa (an SWA allocator's SWA
    sub-pool), req for ReqToTokenPool's rows, where a row is a "page" of size 1 and the tree holds none,
    or mamba for the Mamba state pool's slots, a "page" of size 1 each, held by a live row or a tree node)
    leaked       a page in none of the three: nobody will ever free it. Culprit: the page's last
                 taker in the ledger (the request whose alloc or row took it, the step, the event)
    doubleref    a page both free and in use (in the tree or a live row), or twice in the free list:
                 a double free; the next alloc hands out a page still in use. Named with its last
                 releaser (the request the free was made for)
    twice        a page with two owners, none of them the free list: in two tree nodes, in the tree and
                 in a live row's own part (past its tree prefix), or in two rows' own parts. A page has
                 at most one owner (a row's tree prefix is the tree's): the double free that handed it
                 out again while its owner kept it. Named with both holders and its last releaser
    outside      a page id outside 1..N in the free list (page 0 is SGLang's padding page): counted in
                 no term, named
    stray        a page id outside 1..N in the tree or a live row: such an id in the free list was handed
                 out (the padding page, put there by a free that read a cleared SWA mapping). Counted in no
                 term, named with its holders and its last releaser (the free that put it in the list)
    lockheld     a tree node still locked at the idle point by a request that is no longer live
                 (a lock never released: its pages cannot be evicted). Level summary keeps no lock
                 ledger: there, the pages of a node whose lock count (the tree's own) is above its
                 live holders' (sglang_views.stale_locked_pages), named by their taker
The check row's counts are tokens and balance by construction (each page counted once: in use
first, then free, then leaked): total = available (free) + evictable (in the tree, no live row) +
held (in a live row) + uncached (leaked); protected = tokens under a leaked lock. SGLang's own
identity (available + evictable + protected + session_held + uncached == total) counts pages and
passes when a leak and a double free cancel; the census names both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvscope.telemetry import CensusBlock, LeakCheck

MAX_NAMED = 8  # NOTE: pages named in one check's message; census_blocks stores every one
Entry = tuple[str | None, int, str]  # (rid, step, event)


class PageView(NamedTuple):
    """A pool at one moment: its page size, page count (ids 1..num_pages; 0 is SGLang's padding
    page), the free list as listed (duplicates kept), the tree's pages, and live row pages -> rid;
    `owned`: each live row's own pages (past its tree prefix), one (page, rid) per row holding it, and
    `tree_twice`: the pages two tree nodes hold (the ownership count: PageCensus.twice)."""

    page_size: int
    num_pages: int
    free_list: list[int]
    tree: set[int]
    live: dict[int, str]
    owned: tuple[tuple[int, str], ...] = ()
    tree_twice: frozenset[int] = frozenset()


TREE = "the tree"


@dataclass
class PageCensus:
    pool: str
    page_size: int
    num_pages: int
    free: set[int]
    tree: set[int]
    live: set[int]
    leaked: list[int]
    doubleref: list[int]
    culprits: dict[int, Entry] = field(default_factory=dict)
    releasers: dict[int, Entry] = field(default_factory=dict)
    locks: dict[Any, list[tuple[str | None, int]]] = field(default_factory=dict)  # node -> stale holders
    live_owner: dict[int, str] = field(default_factory=dict)
    stale_locked: list[int] = field(default_factory=list)  # NOTE: level summary: locked pages in no live row
    named_takers: dict[int, Entry] = field(default_factory=dict)  # NOTE: of stale locked and unreleased doubleref pages
    twice: dict[int, list[str]] = field(default_factory=dict)  # NOTE: page -> its holders (TREE or a rid), two or more
    outside: list[int] = field(default_factory=list)  # NOTE: free-list ids outside 1..num_pages
    stray: dict[int, list[str]] = field(default_factory=dict)  # NOTE: ids outside 1..num_pages in use -> holders
    frees_seen: bool = True  # NOTE: False at level summary (no free hooked): a double free's releaser is full's

    @property
    def unit(self) -> str:
        return "row" if self.pool == "req" else "slot" if self.pool == "mamba" else "page"

    @property
    def ok(self) -> bool:
        return not (
            self.leaked or self.doubleref or self.twice or self.outside or self.stray or self.locks or self.stale_locked
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "ok": self.ok,
            "pages": self.num_pages,
            "free": len(self.free),
            "tree": len(self.tree),
            "live": len(self.live),
            "leaked": self.leaked,
            "doubleref": self.doubleref,
            "twice": {str(p): held for p, held in self.twice.items()},
            "outside": self.outside,
            "stray": {str(p): held for p, held in self.stray.items()},
            "culprits": {str(p): e[0] for p, e in self.culprits.items()},
            "releasers": {str(p): e[0] for p, e in self.releasers.items()},
            "locks": {str(n): [h[0] for h in held] for n, held in self.locks.items()},
            "stale_locked": {str(p): (self.named_takers.get(p) or (None,))[0] for p in self.stale_locked},
        }


def take_page_census(
    pool: str,
    view: PageView,
    takers: Mapping[int, Entry],
    releasers: Mapping[int, Entry],
    stale_locks: Mapping[Any, list[tuple[str | None, int]]],
    locked: set[int] | None = None,
    *,
    frees_seen: bool = True,
) -> PageCensus:
    """The census of one pool; `stale_locks`: open locks whose holder is no longer live (the lock
    ledger, level full); `locked`: the pages under a lock no live holder accounts for, by the tree's own
    counts (level summary: sglang_views.stale_locked_pages); `frees_seen`: whether the pool's frees are
    hooked (`releasers` is then the ledger's; not at level summary)."""
    pages = set(range(1, view.num_pages + 1))
    counts = Counter(p for p in view.free_list if p in pages)
    outside = sorted({p for p in view.free_list if p not in pages})
    stray = {
        p: [*([TREE] if p in view.tree else []), *([view.live[p]] if p in view.live else [])]
        for p in sorted((view.tree | set(view.live)) - pages)
    }
    free = set(counts)
    in_use = (view.tree | set(view.live)) & pages
    leaked = sorted(pages - free - in_use)
    doubleref = sorted((free & in_use) | {p for p, n in counts.items() if n > 1})
    twice = holders_of_twice_owned(view)
    stale_locked = sorted(locked) if locked else []
    return PageCensus(
        pool=pool,
        page_size=view.page_size,
        num_pages=view.num_pages,
        free=free,
        tree=view.tree & pages,
        live=set(view.live) & pages,
        leaked=leaked,
        doubleref=doubleref,
        culprits={p: takers[p] for p in leaked if p in takers},
        releasers={p: releasers[p] for p in (*doubleref, *twice, *stray) if p in releasers},
        locks=dict(stale_locks),
        live_owner=dict(view.live),
        stale_locked=stale_locked,
        named_takers={p: takers[p] for p in (*stale_locked, *doubleref, *twice, *stray) if p in takers},
        twice=twice,
        outside=outside,
        stray=stray,
        frees_seen=frees_seen,
    )


def holders_of_twice_owned(view: PageView) -> dict[int, list[str]]:
    """The pages with more than one owner -> their holders (TREE once per tree node holding it, then
    each row's request): a page is the tree's or one live row's own, never both."""
    holders: dict[int, list[str]] = {p: [TREE, TREE] for p in view.tree_twice}
    for page, rid in view.owned:
        if page in view.tree and page not in holders:
            holders[page] = [TREE]
        holders.setdefault(page, []).append(rid)
    return {p: held for p, held in sorted(holders.items()) if len(held) > 1}


def census_checks(step: int, results: list[PageCensus], census: str | None = None) -> list[LeakCheck]:
    """One leak check per pool: the page counts in tokens, the violation naming pages and requests;
    `census`: which census it was (census.CENSUS_KINDS)."""
    checks = []
    for r in results:
        ps = r.page_size
        in_use = r.tree | r.live
        available = len(r.free - in_use) * ps
        evictable = len(r.tree - r.live) * ps
        held = len(r.live) * ps
        uncached = len(r.leaked) * ps
        total = available + evictable + held + uncached
        checks.append(
            LeakCheck(
                step,
                r.pool,
                total,
                available,
                evictable,
                0,
                held,
                uncached,
                idle=True,
                violation=violation(r),
                census=census,
            )
        )
    return checks


# NOTE: census_blocks' term for a page (at most 8 characters): what the census named it for, with the pool's
# tag before it for every pool but full ("s." swa, "r." req rows, "m." mamba slots): a page id is one pool's
#     leaked   in no free list, tree or live row (taker: its last taker)
#     double   free and in use, or twice in the free list (releaser: its last releaser; taker where known)
#     twice    two owners (ref: how many, accounted: 1; releaser: its last releaser)
#     beyond   a free-list id outside 1..N (counted in no term)
#     stray    an id outside 1..N in the tree or a live row (ref: its holders; taker, releaser where known)
#     locked   under a tree lock no live request or session holds (level summary; taker: its last taker)
# A lock that level full's ledger names is a tree node's, not a page's: its check's message names it.
POOL_TAGS = {"full": "", "swa": "s.", "req": "r.", "mamba": "m."}


def census_blocks(step: int, results: list[PageCensus]) -> list[CensusBlock]:
    """Every page each pool's census names (its check's message names MAX_NAMED of each finding)."""
    blocks = []
    for r in results:
        tag = POOL_TAGS.get(r.pool, r.pool[:1] + ".")
        blocks += [CensusBlock(step, f"{tag}leaked", p, taker=r.culprits.get(p)) for p in r.leaked]
        blocks += [
            CensusBlock(step, f"{tag}double", p, taker=r.named_takers.get(p), releaser=r.releasers.get(p))
            for p in r.doubleref
        ]
        blocks += [
            CensusBlock(step, f"{tag}twice", p, len(held), 1, r.named_takers.get(p), r.releasers.get(p))
            for p, held in r.twice.items()
        ]
        blocks += [CensusBlock(step, f"{tag}beyond", p) for p in r.outside]
        blocks += [
            CensusBlock(step, f"{tag}stray", p, len(held), 0, r.named_takers.get(p), r.releasers.get(p))
            for p, held in r.stray.items()
        ]
        blocks += [CensusBlock(step, f"{tag}locked", p, taker=r.named_takers.get(p)) for p in r.stale_locked]
    return blocks


def violation(r: PageCensus) -> str | None:
    """What failed, in one line (None when the pool's census holds)."""
    parts = []
    if r.leaked:
        head = f"{_pages(len(r.leaked), r.unit)} leaked (in no free list, tree or live row)"
        parts.append(_finding(head, r.leaked, _leak_text, r))
    if r.doubleref:
        head = f"{_pages(len(r.doubleref), r.unit)} freed while in use (a double free)"
        parts.append(_finding(head, r.doubleref, _double_text, r))
    if r.twice:
        head = f"{_pages(len(r.twice), r.unit)} held twice (a double free handed out a {r.unit} still in use)"
        parts.append(_finding(head, list(r.twice), _twice_text, r))
    if r.outside:
        parts.append(
            f"{_pages(len(r.outside), r.unit + ' id')} outside 1..{r.num_pages} in the free list: {_named(r.outside)}"
        )
    if r.stray:
        head = f"{_pages(len(r.stray), r.unit + ' id')} outside 1..{r.num_pages} in use (handed out from the free list)"
        parts.append(_finding(head, list(r.stray), _stray_text, r))
    if r.locks:
        parts.append(
            f"{len(r.locks)} tree node{'s' if len(r.locks) != 1 else ''} still locked by finished "
            "requests: " + "; ".join(_lock_text(n, held) for n, held in list(r.locks.items())[:MAX_NAMED])
        )
    if r.stale_locked:
        parts.append(
            f"{_pages(len(r.stale_locked), r.unit)} under a tree lock no live request or session holds (a lock "
            "never released; who locked it is recorded at level full): " + _stale_text(r)
        )
    return " | ".join(parts) if parts else None


def census_line(r: PageCensus, *, why: str, capture: str, run_id: int | None, step: int) -> str:
    """The line the probe prints into SGLang's log (stderr) when a census fails; `kvscope report
    engine-log` finds it beside SGLang's own message and points to the capture."""
    where = f"capture {capture}" + (f" run {run_id}" if run_id is not None else "")
    return f"page census ({why}) at step {step}, {where}: [{r.pool}] {violation(r)}"


def _finding(head: str, pages: list[int], text: Callable[[int, PageCensus], str], r: PageCensus) -> str:
    """One finding of the line: its head, then each of the first MAX_NAMED pages as `text` says it."""
    return f"{head}: " + "; ".join(text(p, r) for p in pages[:MAX_NAMED]) + _more(len(pages))


def _taken(taker: Entry) -> str:
    rid, step, event = taker
    return f"taken by request {rid} ({event} at step {step})"


def _leak_text(page: int, r: PageCensus) -> str:
    taker = r.culprits.get(page)
    who = f"last {_taken(taker)}" if taker else "taker not recorded"
    if r.pool in ("req", "mamba"):
        return f"{r.unit} {page} {who}"
    return f"page {page} (slots {page * r.page_size}-{page * r.page_size + r.page_size - 1}) {who}"


def _stale_text(r: PageCensus) -> str:
    """The stale locked pages grouped by taker (a locked node's pages were taken together)."""
    by_taker: dict[Entry | None, list[int]] = {}
    for page in r.stale_locked:
        by_taker.setdefault(r.named_takers.get(page), []).append(page)
    groups = []
    for taker, pages in list(by_taker.items())[:MAX_NAMED]:
        who = _taken(taker) if taker else "taker not recorded"
        groups.append(f"{'page' if len(pages) == 1 else 'pages'} {_named(pages)} {who}")
    return "; ".join(groups) + (f" (+{len(by_taker) - MAX_NAMED} more takers)" if len(by_taker) > MAX_NAMED else "")


def _named(pages: list[int]) -> str:
    return ", ".join(map(str, pages[:MAX_NAMED])) + _more(len(pages))


def _double_text(page: int, r: PageCensus) -> str:
    where = (
        f"free and in a live row of request {r.live_owner[page]}"
        if page in r.live_owner
        else "free and in the tree"
        if page in r.tree
        else "twice in the free list"
    )
    last = r.releasers.get(page)
    taker = r.named_takers.get(page)
    if last:
        return f"{r.unit} {page} {where}; {_released(last)}"
    unknown = "its releaser not recorded" if r.frees_seen else "who freed it is recorded at level full"
    who = f"; {_taken(taker)}, {unknown}" if taker else f"; {unknown}"
    return f"{r.unit} {page} {where}{who}"


def _twice_text(page: int, r: PageCensus) -> str:
    holders = r.twice[page]
    in_tree = holders.count(TREE)
    where = [f"{in_tree} tree nodes" if in_tree > 1 else TREE] if in_tree else []
    held = " and ".join([*where, *(f"request {h}'s row" for h in holders if h != TREE)])
    last = r.releasers.get(page)
    return f"{r.unit} {page} in {held}" + (f"; {_released(last)}" if last else "")


def _stray_text(page: int, r: PageCensus) -> str:
    held = " and ".join(TREE if h == TREE else f"request {h}'s row" for h in r.stray[page])
    taker = r.named_takers.get(page)
    last = r.releasers.get(page)
    return (
        f"{r.unit} {page} in {held}"
        + (f", {_taken(taker)}" if taker else "")
        + (f"; {_released(last)}" if last else "")
    )


def _released(last: Entry) -> str:
    """Who made a page's last free: the request whose call freed it, or why no request is known."""
    rid, step, event = last
    if rid is not None:
        return f"last released for request {rid} ({event} at step {step})"
    if event == "group":
        return f"last released by a batch's free group at step {step} (request unknown: a group frees several at once)"
    return f"last released at step {step} outside any request's call (request unknown)"


def _lock_text(node: Any, held: list[tuple[str | None, int]]) -> str:
    return f"node {node} locked by " + ", ".join(
        f"request {rid} at step {step}"
        if rid is not None
        else f"an unknown request at step {step} (locked outside any request's call)"
        for rid, step in held
    )


def _pages(count: int, unit: str = "page") -> str:
    return f"{count} {unit}{'s' if count != 1 else ''}"


def _more(count: int) -> str:
    return f" (+{count - MAX_NAMED} more)" if count > MAX_NAMED else ""
