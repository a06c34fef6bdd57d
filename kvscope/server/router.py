"""The data-parallel router of `kvscope serve --dp-size N`: which rank's scheduler takes each choice.

    router = Router("prefix_affinity", num_ranks=2, page_size=16)
    router.took_pages(1, PagesOut(stored=[...], removed=[]))   # a rank's cache deltas
    router.took_stats(1, stats)                                # a rank's loads
    rank, route = router.choose(input_ids)                     # RouteInfo for the requests row
    router.finished(rank, len(input_ids))                      # the choice ended

NOTE: what the router knows of each rank (docs/serve.md, "Data-parallel ranks")
    loads        the Dispatcher's (kvscope.fleet): each StatsOut's running + waiting requests and
                 full-pool tokens replace the estimate; a choice counts against its rank at once
    held pages   the set of block hashes of the full pages the rank's cache holds, from none,
                 updated by each PagesOut (removed first, then stored; only with N > 1)
    cached       a prompt's cached tokens on rank r = the longest run of its page hashes, from
                 the first, in r's set x page size
    live         False once the rank's process died: choose skips it and its held pages are
                 dropped (its cache died with it); with none live, choose raises DispatchError
    answering    False while the rank's process lives but has sent nothing for a bound (the front
                 marks it: a hung process, as a stuck kernel leaves it): choose skips it as a dead
                 one, its pages kept; True again with its next message
Every choice with N > 1 carries RouteInfo(method, cached on the chosen rank, most cached on
another); with one rank, choose is rank 0 and None (no routing to record).
The router holds no sockets and no tasks: the front reads each rank's socket and calls it, from
one asyncio loop (not thread-safe).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.fleet.dispatch import Dispatcher
from kvscope.server.kv_events import prompt_page_hashes
from kvscope.server.protocol import PagesOut, RouteInfo, StatsOut


@dataclass
class Replica:
    """One scheduler process (a data-parallel rank) as the router knows it."""

    stats: StatsOut | None = None
    pages: set[int] = field(default_factory=set)  # block hashes of the full pages its cache holds (N > 1)
    live: bool = True
    answering: bool = True
    pid: int | None = None

    @property
    def dispatchable(self) -> bool:
        return self.live and self.answering

    def cached_tokens(self, page_hashes: list[int], page_size: int) -> int:
        """The prompt's longest prefix this replica holds, in tokens."""
        num_pages = 0
        for page_hash in page_hashes:
            if page_hash not in self.pages:
                break
            num_pages += 1
        return num_pages * page_size


class Router:
    """The ranks, their loads, the pages each holds, and the choice of a rank per prompt."""

    def __init__(self, method: str, num_ranks: int, page_size: int) -> None:
        """DispatchError for an unknown method or fewer than one rank."""
        self.dispatcher = Dispatcher(method, num_ranks)
        self.replicas = [Replica() for _ in range(num_ranks)]
        self.page_size = page_size

    @property
    def method(self) -> str:
        return self.dispatcher.method

    @property
    def all_reported(self) -> bool:
        """Every rank has sent its stats once (the server is ready)."""
        return all(replica.stats is not None for replica in self.replicas)

    def took_stats(self, rank: int, stats: StatsOut) -> None:
        self.replicas[rank].stats = stats
        self.dispatcher.loads(rank, stats.num_running + stats.num_waiting, stats.pools["full"].used)

    def took_pages(self, rank: int, pages: PagesOut) -> None:
        held = self.replicas[rank].pages
        held.difference_update(pages.removed)
        held.update(pages.stored)

    def rank_exited(self, rank: int) -> None:
        """The rank's process is gone, and its cache with it: choose skips it from now on, and no
        later choice counts its pages as cached elsewhere (a routing loss no rank could avoid)."""
        replica = self.replicas[rank]
        replica.live = False
        replica.pages.clear()

    def live_ranks(self) -> list[int]:
        """Ranks whose process lives (answering or not)."""
        return [rank for rank, replica in enumerate(self.replicas) if replica.live]

    def answering_ranks(self) -> list[int]:
        """Ranks whose process lives and answers: the ones choose picks from."""
        return [rank for rank, replica in enumerate(self.replicas) if replica.dispatchable]

    def silent_ranks(self) -> list[int]:
        """Ranks whose process lives but does not answer."""
        return [rank for rank, replica in enumerate(self.replicas) if replica.live and not replica.answering]

    def dead_ranks(self) -> list[int]:
        return [rank for rank, replica in enumerate(self.replicas) if not replica.live]

    def cached_tokens(self, input_ids: list[int]) -> list[int]:
        """The prompt's cached tokens on each rank (see the module NOTE)."""
        hashes = prompt_page_hashes(input_ids, self.page_size)
        return [replica.cached_tokens(hashes, self.page_size) for replica in self.replicas]

    def choose(self, input_ids: list[int]) -> tuple[int, RouteInfo | None]:
        """The rank for a prompt and what the router saw (None with one rank); DispatchError
        when no rank lives."""
        if len(self.replicas) == 1:
            return 0, None
        cached = self.cached_tokens(input_ids)
        live = [replica.dispatchable for replica in self.replicas]
        rank = self.dispatcher.choose(len(input_ids), cached, live)
        elsewhere = max((n for r, n in enumerate(cached) if r != rank), default=0)
        return rank, RouteInfo(self.dispatcher.method, cached[rank], elsewhere)

    def finished(self, rank: int, prompt_tokens: int) -> None:
        """A choice sent to `rank` ended (finished, aborted or failed)."""
        self.dispatcher.finished(rank, prompt_tokens)
