"""The summary-level records a recorder stores besides events (all plain values)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

LEVELS = ("off", "summary", "full")


class RunStatus(StrEnum):
    """A run's stored status (runs.status). Readers add 'ended without closing' for a run
    still 'running' whose writer is gone (queries.display_status)."""

    RUNNING = "running"
    FINISHED = "finished"  # ran to its end and closed its capture
    INTERRUPTED = "interrupted"  # stopped by Ctrl-C, SIGTERM or SIGHUP; closed its capture
    CRASHED = "crashed"  # an exception stopped it; runs.error holds its one line
    INCOMPLETE = "incomplete"  # recording stopped on a write failure; runs.error says through which step


class RequestStatus(StrEnum):
    """A request's stored status (requests.status)."""

    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    UNFINISHED = "unfinished"  # never finished: the run ended (drained, limit) with it waiting
    IN_FLIGHT = "in_flight"  # the run was interrupted or crashed while it was admitted or waiting


class NodeRow(NamedTuple):
    """One node of a cache's flat node table, as a tree snapshot stores it: the fields are
    schema.TREE_NODE_COLUMNS, in that order (a test checks)."""

    node_id: int
    parent_id: int | None
    num_tokens: int
    token_preview: str
    lock_ref: int
    last_access_time: float
    hit_count: int
    owner: str | None
    tombstone: bool
    depth_tokens: int
    visibility: str = "public"  # private / public / pinned (scoped radix); global-sharing trees: public
    tier: str = "device"  # device / device+host / host (hiradix); single-tier caches: device
    page_hashes: bytes | None = None  # the node's full pages' chained hashes (page_hash.py); None: not known


class PoolTerms(NamedTuple):
    """Token counts of one pool at one moment."""

    total: int
    available: int
    evictable: int
    protected: int

    @property
    def used(self) -> int:
        """SGLang's definition: total - (available + evictable); includes protected tokens."""
        return self.total - self.available - self.evictable


class UsageSample(NamedTuple):
    """One step's usage row. An engine run fills every field; an attached engine (`kvscope
    attach`) leaves None where its source does not say (schema version 5 stores NULL there)."""

    step: int
    full: PoolTerms
    swa: PoolTerms | None
    req_total: int
    req_available: int
    num_running: int
    num_waiting: int
    cum_prompt_tokens: int
    cum_hit_tokens: int
    cum_requests: int
    cum_hit_requests: int
    cum_evicted_tokens: int
    cum_retractions: int
    host: PoolTerms | None = None  # the host tier (hiradix); None: no host tier
    cum_host_hit_tokens: int = 0  # of cum_hit_tokens, the tokens loaded back from the host at admission
    cum_written_tokens: int = 0  # device -> host copies started
    cum_loaded_tokens: int = 0  # host -> device copies started
    full_used: int | None = None  # device tokens in use; None: full.total - full.available - full.evictable


class LeakCheck(NamedTuple):
    """One pool's invariant: available + evictable + protected + held + uncached == total.

    At an idle point (`idle`), nothing may stay locked either: protected must be 0. SGLang's
    equation alone counts a lock that is never released as balanced.

    `violation`: a check that is not this equation (a census term of the vLLM probe: the terms
    above are the block pool's counts, the violation says what failed and names the culprits);
    None when the term holds. `census`: which census of a probe the row belongs to (busy, idle,
    drain, poll); None for kvscope's own engines' checks.
    """

    step: int
    pool: str
    total: int
    available: int
    evictable: int
    protected: int
    held: int
    uncached: int
    idle: bool = True
    violation: str | None = None
    census: str | None = None

    @property
    def balanced(self) -> bool:
        return self.available + self.evictable + self.protected + self.held + self.uncached == self.total

    @property
    def ok(self) -> bool:
        return self.balanced and not (self.idle and self.protected) and self.violation is None

    def message(self) -> str:
        terms = (
            f"[{self.pool}] total={self.total}, available={self.available}, evictable={self.evictable}, "
            f"protected={self.protected}, held={self.held}, uncached={self.uncached}"
        )
        if self.violation is not None:
            return f"{terms}: {self.violation}"
        if not self.balanced:
            gap = self.total - (self.available + self.evictable + self.protected + self.held + self.uncached)
            return f"{terms}: {abs(gap)} tokens {'missing' if gap > 0 else 'counted twice'}"
        if self.idle and self.protected:
            return f"{terms}: {self.protected} tokens still locked at an idle point"
        return terms


class CensusBlock(NamedTuple):
    """One block (page) a census names under one of its terms (the leak check's pool) at a step:
    its ref count and the references accounted for (None where the term reads none), and who last
    took and released it, each (rid, step, event) or None when the probe did not see it."""

    step: int
    term: str
    block: int
    ref: int | None = None
    accounted: int | None = None
    taker: tuple[str | None, int, str] | None = None
    releaser: tuple[str | None, int, str] | None = None

    def row(self) -> tuple[Any, ...]:
        """The census_blocks row after run_id (schema.CENSUS_BLOCK_COLUMNS[1:])."""
        taker, releaser = self.taker or (None, None, None), self.releaser or (None, None, None)
        return (self.step, self.term, self.block, self.ref, self.accounted, *taker, *releaser)


@dataclass(frozen=True)
class Routing:
    """What a fleet's router saw when it sent a request to this replica: the dispatch method and,
    in prompt tokens, how much of the prompt was cached here and the most cached on any other
    replica. Their difference (when positive) is the request's routing loss."""

    dispatch: str
    routed_cached_tokens: int
    elsewhere_cached_tokens: int

    @property
    def loss_tokens(self) -> int:
        return max(0, self.elsewhere_cached_tokens - self.routed_cached_tokens)


@dataclass
class RequestRecord:
    """A request's life as the requests table stores it; times are monotonic seconds."""

    rid: str
    principal: str | None
    prompt_len: int
    status: str = "running"
    cached_tokens: int = 0
    output_len: int = 0
    num_retractions: int = 0
    times: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    routing: Routing | None = None  # how a fleet's router chose this replica (None: not routed)

    def mark(self, moment: str, step: int, t_mono: float) -> None:
        """Record a moment (arrive, admit, first_token, finish, retract); retract keeps the latest."""
        if moment not in self.times or moment == "retract":
            self.times[moment] = t_mono
            self.steps[moment] = step
