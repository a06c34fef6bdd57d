"""The summary-level records a recorder stores besides events (all plain values)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

LEVELS = ("off", "summary", "full")


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


class LeakCheck(NamedTuple):
    """One pool's idle invariant: available + evictable + protected + held + uncached == total."""

    step: int
    pool: str
    total: int
    available: int
    evictable: int
    protected: int
    held: int
    uncached: int

    @property
    def ok(self) -> bool:
        return self.available + self.evictable + self.protected + self.held + self.uncached == self.total

    def message(self) -> str:
        return (
            f"[{self.pool}] total={self.total}, available={self.available}, evictable={self.evictable}, "
            f"protected={self.protected}, held={self.held}, uncached={self.uncached}"
        )


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

    def mark(self, moment: str, step: int, t_mono: float) -> None:
        """Record a moment (arrive, admit, first_token, finish, retract); retract keeps the latest."""
        if moment not in self.times or moment == "retract":
            self.times[moment] = t_mono
            self.steps[moment] = step
