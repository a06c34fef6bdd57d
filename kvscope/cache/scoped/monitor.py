"""The anomaly monitor: trips on the hit pattern of a probe against a public node (off by default).

A public node is tripped when, within the current epoch, either
    burst      hits > alpha * max(previous epoch's hits, min_hits) and at least `min_new_users`
               distinct principals hit it (many accounts probing token by token), or
    hammering  hits >= min_hits and distinct principals / hits < min_user_ratio (a few accounts
               hammering one prefix).
A tripped node's subtree is demoted: tombstoned at once (invisible to everyone), its pages freed
once no request holds them. Demotion bounds further leakage; it cannot take back what leaked.
The knobs need calibrating on benign traces (the note says as much); bench_isolation reports
trips on the multi-tenant workload, which should be zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MonitorConfig:
    alpha: float = 10.0
    min_hits: int = 20
    min_new_users: int = 4
    min_user_ratio: float = 0.05

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and self.min_hits >= 1 and self.min_new_users >= 1 and 0 <= self.min_user_ratio <= 1):
            raise ValueError(f"monitor knobs out of range: {self}")

    def tripped(self, hits: int, previous_hits: int, users: int) -> bool:
        burst = hits > self.alpha * max(previous_hits, self.min_hits) and users >= self.min_new_users
        hammering = hits >= self.min_hits and users / hits < self.min_user_ratio
        return burst or hammering
