"""Errors raised by the pools. Messages name the pool and the slots involved."""

from __future__ import annotations

from collections.abc import Iterable


class PoolMisuseError(ValueError):
    """A caller broke a pool's contract (double free, padding slot, misalignment, ...)."""

    def __init__(self, pool_name: str, problem: str, slots: Iterable[int] = ()) -> None:
        shown = list(slots)
        suffix = ""
        if shown:
            head = ", ".join(str(s) for s in shown[:16])
            more = f" (+{len(shown) - 16} more)" if len(shown) > 16 else ""
            suffix = f": slots [{head}]{more}"
        super().__init__(f"[{pool_name}] {problem}{suffix}")
        self.pool_name = pool_name
        self.problem = problem
        self.slots = shown


class IntegrityError(AssertionError):
    """check_integrity() found a broken invariant; the message prints the numbers."""
