"""Dispatch methods: which replica of a data-parallel fleet takes the next request.

    dispatcher = Dispatcher("prefix_affinity", replicas=2)
    rank = dispatcher.choose(prompt_tokens=120, cached_tokens=[96, 0])   # 0: it holds the prefix
    dispatcher.loads(rank=0, requests=3, tokens=900)                      # from the replica's stats
    dispatcher.finished(rank)                                             # the request ended

NOTE: the methods (SGLang 0.5.23's DataParallelController and DPBudget, plus our own)
    round_robin      rank 0, 1, ..., N-1, 0, ...
    total_requests   the fewest running + waiting requests (SGLang's "shortest queue")
    total_tokens     the fewest tokens held, ties by requests
    prefix_affinity  kvscope's: the replica that holds the longest prefix of the prompt, as the
                     replicas themselves report it (their cached pages), not a router's guess;
                     ties and prompts cached nowhere go to the fewest requests, and a replica
                     more than AFFINITY_SLACK_REQUESTS requests above the least loaded one is
                     passed over (affinity must not pile a hot prefix onto one replica)
As SGLang's budget does, a choice counts the request (and its prompt tokens) against the chosen
replica at once, until the replica's next report replaces the estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DISPATCH_METHODS = ("round_robin", "total_requests", "total_tokens", "prefix_affinity")
AFFINITY_SLACK_REQUESTS = 4


class DispatchError(ValueError):
    """A dispatch method or fleet size kvscope does not know."""


@dataclass
class ReplicaLoad:
    requests: int = 0  # running + waiting
    tokens: int = 0  # tokens held or queued


def check_method(method: str) -> str:
    if method not in DISPATCH_METHODS:
        raise DispatchError(f"unknown dispatch method {method!r}: choose one of {', '.join(DISPATCH_METHODS)}")
    return method


class Dispatcher:
    """Chooses a replica per request; not thread-safe (one router task calls it)."""

    def __init__(self, method: str, replicas: int) -> None:
        if replicas < 1:
            raise DispatchError(f"a fleet needs at least one replica, not {replicas}")
        self.method = check_method(method)
        self.load = [ReplicaLoad() for _ in range(replicas)]
        self._next = 0

    @property
    def replicas(self) -> int:
        return len(self.load)

    def choose(
        self, prompt_tokens: int, cached_tokens: Sequence[int] | None = None, live: Sequence[bool] | None = None
    ) -> int:
        """The rank for a request of prompt_tokens; cached_tokens[r] is how much of its prompt replica r
        holds (prefix_affinity needs it); live[r] False skips a replica that is gone."""
        ranks = [r for r in range(self.replicas) if live is None or live[r]]
        if not ranks:
            raise DispatchError("no replica is live")
        rank = self._pick(ranks, cached_tokens)
        self.load[rank].requests += 1
        self.load[rank].tokens += prompt_tokens
        return rank

    def _pick(self, ranks: list[int], cached_tokens: Sequence[int] | None) -> int:
        if self.method == "round_robin":
            while self._next % self.replicas not in ranks:
                self._next += 1
            rank = self._next % self.replicas
            self._next = rank + 1
            return rank
        fewest = min(ranks, key=lambda r: (self.load[r].requests, r))
        if self.method == "total_requests":
            return fewest
        if self.method == "total_tokens":
            return min(ranks, key=lambda r: (self.load[r].tokens, self.load[r].requests, r))
        if cached_tokens is None:
            raise DispatchError("prefix_affinity needs each replica's cached prefix length")
        floor = self.load[fewest].requests + AFFINITY_SLACK_REQUESTS
        eligible = [r for r in ranks if self.load[r].requests <= floor]
        return max(eligible, key=lambda r: (cached_tokens[r], -self.load[r].requests, -r))

    def loads(self, rank: int, requests: int, tokens: int) -> None:
        """A replica's own count replaces the estimate."""
        self.load[rank] = ReplicaLoad(requests, tokens)

    def finished(self, rank: int, prompt_tokens: int = 0) -> None:
        """A request of this replica ended (between two of its reports)."""
        load = self.load[rank]
        load.requests = max(0, load.requests - 1)
        load.tokens = max(0, load.tokens - prompt_tokens)
