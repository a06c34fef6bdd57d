"""The usage chart's buckets (Capture.usage), kept from one read of a run to the next: a live
dashboard's refresh aggregates the rows appended since, not the run's every row again.

NOTE: buckets that never change
    A run's steps are cut into buckets of `width` steps from its first step `lo`, and each bucket
    keeps, per pool, its peak row. The width is the least power of two that leaves at most
    `num_buckets` buckets, so as the run grows it only doubles: two neighbouring buckets become one,
    whose peak is the larger of their two (a key orders rows by peak, then step). A bucket is final
    once the run's last step is past its end: one recorder writes a run's rows in step order, a
    transaction at a time, so no row can join it later. A read aggregates from the first bucket
    that is not final. Retention thins old usage rows; a kept peak row that is gone then shows as a
    kept step the read does not find, and the caller starts over (Capture.usage).
NOTE: keys
    A row's key in a bucket is peak * scale + (step - lo), with peak -1 where a pool has no value and
    scale a power of two above every offset: max() picks the peak row, the latest on a tie, and the
    step is lo + key % scale. Exact while |peak| * scale < 2**63 (peaks under 2**31 tokens with the
    scale at its least, 2**32 steps).
"""

from __future__ import annotations

from typing import NamedTuple

LEAST_SCALE = 1 << 32


def bucket_width(span_steps: int, num_buckets: int) -> int:
    """The least power of two `w` with ceil(span_steps / w) <= num_buckets."""
    need = -(-span_steps // max(1, num_buckets))
    return 1 << max(0, need - 1).bit_length()


def key_scale(span_steps: int) -> int:
    """The power of two a key's step offset is kept under (see the NOTE)."""
    return max(LEAST_SCALE, 1 << span_steps.bit_length())


class UsageBuckets(NamedTuple):
    """What a read of one run's usage (for one `num_buckets` and set of pools) found: the buckets
    before `final` are whole; `keys` maps a bucket to each pool's key in it."""

    lo: int
    pools: tuple[bool, bool]  # NOTE: (swa, host): which peaks the keys hold, after the full pool's
    num_buckets: int
    scale: int
    width: int
    final: int
    hi: int
    keys: dict[int, tuple[int, ...]]

    @classmethod
    def empty(cls, lo: int, pools: tuple[bool, bool], num_buckets: int, hi: int) -> UsageBuckets:
        span = hi - lo + 1
        return cls(lo, pools, num_buckets, key_scale(span), bucket_width(span, num_buckets), 0, lo - 1, {})

    def fits(self, lo: int, pools: tuple[bool, bool], num_buckets: int, hi: int) -> bool:
        """Whether a read of the run as it is now may go on from these buckets."""
        return (
            (self.lo, self.pools, self.num_buckets) == (lo, pools, num_buckets)
            and hi >= self.hi
            and hi - lo < self.scale
        )

    def widened(self, hi: int) -> UsageBuckets:
        """These buckets for the run through `hi`: merged where the width doubled, the buckets not
        final dropped (the next read aggregates them again)."""
        width = bucket_width(hi - self.lo + 1, self.num_buckets)
        if width <= self.width:
            return self
        factor = width // self.width
        final = self.final // factor
        keys: dict[int, tuple[int, ...]] = {}
        for bucket, found in self.keys.items():
            if bucket < final * factor:
                merged = keys.get(bucket // factor)
                keys[bucket // factor] = found if merged is None else tuple(map(max, merged, found))
        return self._replace(width=width, final=final, keys=keys)

    @property
    def first_open_offset(self) -> int:
        """The step offset (from lo) a read aggregates from."""
        return self.final * self.width

    def with_found(self, found: list[tuple[int, ...]], hi: int) -> UsageBuckets:
        """These buckets after a read through `hi` aggregated each open bucket's keys (`found`: one
        tuple of keys per bucket, in any order)."""
        keys = {bucket: value for bucket, value in self.keys.items() if bucket < self.final}
        for row in found:
            keys[(row[0] % self.scale) // self.width] = tuple(int(key) for key in row)
        return self._replace(final=(hi - self.lo + 1) // self.width, hi=hi, keys=keys)

    def steps(self) -> set[int]:
        """The steps of the kept rows, the run's last (`hi`) included."""
        return {self.hi, *(self.lo + key % self.scale for found in self.keys.values() for key in found)}
