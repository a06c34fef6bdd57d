"""The cached-prefix forest of a real engine, per tier at page granularity, rebuilt from its KV events.

    forest = PageForest()
    for frame in subscriber.poll(100):
        forest.apply(frame.batch)
    forest.counts()["device"].num_tokens      # cached tokens on the device now
    forest.snapshot()                         # one row per live page, parents before children

NOTE: a page is keyed by its block hash (unsigned, as wire.block_key makes it). Its state:
    parent_hash     the page before it in its prefix (None: the prefix starts at the root)
    token_ids       its tokens (block_size of them; the last page of a store may be short)
    tiers           the tiers that hold it now; a page on no tier is gone
    stored_at       the ts of the batch that first stored this life of the page
A hash stored again keeps its first parent and tokens (only SGLang <= 0.5.2's content hashes alias).
An event per tier:
    Stored   each page joins the tier (a page already on it: no change, not counted again)
    Removed  the page leaves the tier; a remove of a page not on that tier is `unknown_removes`
             (a late joiner missed its store); removes on the device are the evictions
    Cleared  every page of every tier is gone; `resets` += 1 (cumulative counts stay)
Moves (`moves[(src, dst)]`, tiers ordered fastest first as in wire.TIERS):
    demoted      a page leaves a tier while it stays on a slower one (HiCache: evicted from the
                 device after its host backup) -> (the tier it left, the fastest one it is on)
    loaded back  a page is stored on a tier faster than every tier it is on -> (the fastest
                 tier it was on, the new tier); a store on a slower tier is a backup, no move
Orphans: a live page whose parent hash is not a live page (a late joiner's unknown prefix, or
a parent that left every tier before its child) is an unknown root; `num_orphans` counts them.
Groups: only vLLM's main attention group (group 0, SGLang's only group) is kept; events of
other groups (sliding-window, mamba chains of hybrid models) are counted in `ignored_events`
and skipped, as Dynamo's indexer does: their chains would alias the main forest's prefixes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from kvscope.attach.wire import TIERS, Batch, Cleared, Removed, Stored

PREVIEW_TOKENS = 8
_RANK = {tier: rank for rank, tier in enumerate(TIERS)}


class ForestIntegrityError(AssertionError):
    """The forest's counters disagree with a recount of its pages (a bug in this module)."""


@dataclass(slots=True)
class LivePage:
    parent_hash: int | None
    token_ids: tuple[int, ...]
    num_tokens: int
    tiers: set[str]
    stored_at: float


@dataclass(slots=True)
class TierCounts:
    """One tier's pages and tokens now, and its cumulative stores and removes (evictions)."""

    num_pages: int = 0
    num_tokens: int = 0
    num_stored_pages: int = 0
    num_stored_tokens: int = 0
    num_removed_pages: int = 0
    num_removed_tokens: int = 0


class PageRow(NamedTuple):
    """A live page in a tree snapshot; `depth_tokens` counts the tokens of its known prefix,
    itself included (an orphan's prefix starts at its first known ancestor)."""

    page_hash: int
    parent_hash: int | None
    tiers: tuple[str, ...]
    num_tokens: int
    depth_tokens: int
    token_preview: tuple[int, ...]
    stored_at: float
    orphan: bool


@dataclass
class PageForest:
    pages: dict[int, LivePage] = field(default_factory=dict)
    # NOTE: parent hash (None for the root, or a hash that is not live) -> its live child pages
    children: dict[int | None, set[int]] = field(default_factory=dict)
    tiers: dict[str, TierCounts] = field(default_factory=lambda: {tier: TierCounts() for tier in TIERS})
    moves: Counter[tuple[str, str]] = field(default_factory=Counter)
    num_orphans: int = 0
    unknown_removes: int = 0
    ignored_events: int = 0
    resets: int = 0
    num_batches: int = 0
    last_ts: float | None = None

    # -- applying events ------------------------------------------------------------------------

    def apply(self, batch: Batch) -> None:
        """Apply every event of one batch, in order."""
        for event in batch.events:
            if isinstance(event, Cleared):
                self.clear()
            elif event.group != 0:
                self.ignored_events += 1
            elif isinstance(event, Stored):
                self._store(event, batch.ts)
            elif isinstance(event, Removed):
                for page_hash in event.block_hashes:
                    self._remove(page_hash, event.tier)
        self.num_batches += 1
        self.last_ts = batch.ts

    def clear(self) -> None:
        """Every page leaves every tier (an engine's flush or restart)."""
        self.pages.clear()
        self.children.clear()
        self.num_orphans = 0
        for counts in self.tiers.values():
            counts.num_pages = counts.num_tokens = 0
        self.resets += 1

    def _store(self, event: Stored, ts: float) -> None:
        for page_hash, parent_hash, token_ids in event.pages():
            page = self.pages.get(page_hash)
            if page is None:
                page = self._add_page(page_hash, parent_hash, token_ids, ts)
            elif event.tier in page.tiers:
                continue
            elif _RANK[event.tier] < min(_RANK[tier] for tier in page.tiers):
                self.moves[(_fastest(page.tiers), event.tier)] += 1
            page.tiers.add(event.tier)
            counts = self.tiers[event.tier]
            counts.num_pages += 1
            counts.num_tokens += page.num_tokens
            counts.num_stored_pages += 1
            counts.num_stored_tokens += page.num_tokens

    def _remove(self, page_hash: int, tier: str) -> None:
        page = self.pages.get(page_hash)
        if page is None or tier not in page.tiers:
            self.unknown_removes += 1
            return
        page.tiers.discard(tier)
        counts = self.tiers[tier]
        counts.num_pages -= 1
        counts.num_tokens -= page.num_tokens
        counts.num_removed_pages += 1
        counts.num_removed_tokens += page.num_tokens
        if not page.tiers:
            self._drop_page(page_hash, page)
        elif _RANK[tier] < min(_RANK[other] for other in page.tiers):
            self.moves[(tier, _fastest(page.tiers))] += 1

    def _add_page(self, page_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], ts: float) -> LivePage:
        page = LivePage(parent_hash, tuple(token_ids), len(token_ids), set(), ts)
        self.pages[page_hash] = page
        self.children.setdefault(parent_hash, set()).add(page_hash)
        self.num_orphans -= len(self.children.get(page_hash, ()))  # its children found their parent
        if parent_hash is not None and parent_hash not in self.pages:
            self.num_orphans += 1
        return page

    def _drop_page(self, page_hash: int, page: LivePage) -> None:
        del self.pages[page_hash]
        siblings = self.children[page.parent_hash]
        siblings.discard(page_hash)
        if not siblings:
            del self.children[page.parent_hash]
        if page.parent_hash is not None and page.parent_hash not in self.pages:
            self.num_orphans -= 1
        self.num_orphans += len(self.children.get(page_hash, ()))  # its children lost their parent

    # -- reading ------------------------------------------------------------------------------

    def counts(self) -> dict[str, TierCounts]:
        """A copy of every tier's counters now (sample it after each batch for a timeline)."""
        return {
            tier: TierCounts(
                c.num_pages,
                c.num_tokens,
                c.num_stored_pages,
                c.num_stored_tokens,
                c.num_removed_pages,
                c.num_removed_tokens,
            )
            for tier, c in self.tiers.items()
        }

    @property
    def demoted(self) -> int:
        return sum(n for (src, dst), n in self.moves.items() if _RANK[dst] > _RANK[src])

    @property
    def loaded_back(self) -> int:
        return sum(n for (src, dst), n in self.moves.items() if _RANK[dst] < _RANK[src])

    def roots(self) -> list[int]:
        """Live pages whose parent is the root or not live (unknown roots), in store order."""
        return [h for h, page in self.pages.items() if page.parent_hash is None or page.parent_hash not in self.pages]

    def tier_pages(self, tier: str) -> dict[int, LivePage]:
        return {h: page for h, page in self.pages.items() if tier in page.tiers}

    def prefix_tokens(self, page_hash: int) -> list[int]:
        """The known prefix's tokens ending with this page's (from its first known ancestor)."""
        chain: list[tuple[int, ...]] = []
        node: int | None = page_hash
        while node is not None and node in self.pages and len(chain) <= len(self.pages):  # NOTE: bounded
            chain.append(self.pages[node].token_ids)
            node = self.pages[node].parent_hash
        return [token for tokens in reversed(chain) for token in tokens]

    def snapshot(self, preview_tokens: int = PREVIEW_TOKENS) -> list[PageRow]:
        """Every live page, parents before children (depth-first from the roots)."""
        rows: list[PageRow] = []
        stack = [(h, 0) for h in reversed(self.roots())]
        while stack:
            page_hash, above = stack.pop()
            page = self.pages[page_hash]
            depth = above + page.num_tokens
            orphan = page.parent_hash is not None and page.parent_hash not in self.pages
            rows.append(
                PageRow(
                    page_hash,
                    page.parent_hash,
                    _ordered(page.tiers),
                    page.num_tokens,
                    depth,
                    page.token_ids[:preview_tokens],
                    page.stored_at,
                    orphan,
                )
            )
            stack += [(child, depth) for child in sorted(self.children.get(page_hash, ()), reverse=True)]
        return rows

    def check_integrity(self) -> None:
        """Every counter equals a recount of the pages, `children` indexes exactly the live
        pages, and every live page's parent is live, the root, or counted as an orphan."""
        recount = {tier: [0, 0] for tier in TIERS}
        for page in self.pages.values():
            if not page.tiers:
                raise ForestIntegrityError(f"a live page on no tier: {page}")
            for tier in page.tiers:
                recount[tier][0] += 1
                recount[tier][1] += page.num_tokens
        for tier, (num_pages, num_tokens) in recount.items():
            counts = self.tiers[tier]
            if (counts.num_pages, counts.num_tokens) != (num_pages, num_tokens):
                raise ForestIntegrityError(
                    f"{tier}: counted {counts.num_pages} pages / {counts.num_tokens} tokens, "
                    f"recount {num_pages} / {num_tokens}"
                )
        indexed = {(parent, child) for parent, kids in self.children.items() for child in kids}
        expected = {(page.parent_hash, h) for h, page in self.pages.items()}
        if indexed != expected or any(not kids for kids in self.children.values()):
            raise ForestIntegrityError(f"children index: {len(indexed)} links for {len(expected)} live pages")
        orphans = sum(1 for p in self.pages.values() if p.parent_hash is not None and p.parent_hash not in self.pages)
        if orphans != self.num_orphans:
            raise ForestIntegrityError(f"num_orphans {self.num_orphans} but {orphans} pages have no live parent")


def _fastest(tiers: set[str]) -> str:
    return min(tiers, key=_RANK.__getitem__)


def _ordered(tiers: set[str]) -> tuple[str, ...]:
    return tuple(sorted(tiers, key=_RANK.__getitem__))
