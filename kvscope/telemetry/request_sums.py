"""A run's request totals and latency histograms, kept as its request rows are written (schema version 12),
so the Requests page reads a few hundred rows, not every request, at 100 M events.

NOTE: two tables, keyed by run and principal (NO_PRINCIPAL for a request without one), each row a sum
that a later batch of the same key adds to (the writer's upserts, in the transaction of the request rows):
    request_sums       (status): requests, prompt tokens, cached tokens, retractions
    request_latencies  (latency, bucket): requests, their least and greatest latency in ms
A latency is `end - start` of REQUEST_LATENCIES' moments in ms, for a request that reached both moments
with end >= start (as the page's exact read counts it). Bucket b >= 0 holds latencies in
    [FLOOR_MS * 2**(b / BUCKETS_PER_DOUBLING), FLOOR_MS * 2**((b + 1) / BUCKETS_PER_DOUBLING))
and bucket -1 those below FLOOR_MS (zero among them): a bucket is 1.09% wide, so a value read as its
bucket's geometric middle is within MAX_RELATIVE_ERROR of the true one (or FLOOR_MS below it).
Pure numpy: the writer process imports it without SQLAlchemy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

REQUEST_LATENCIES = {  # NOTE: name -> (end moment, start moment), columns of the requests table
    "queue": ("admit_t", "arrive_t"),
    "time to first token": ("first_token_t", "arrive_t"),
    "end to end": ("finish_t", "arrive_t"),
}
BUCKETS_PER_DOUBLING = 64
FLOOR_MS = 0.001
MAX_RELATIVE_ERROR = 2 ** (1 / (2 * BUCKETS_PER_DOUBLING)) - 1  # NOTE: half a bucket, geometrically: 0.54%
NO_PRINCIPAL = ""
SUM_COLUMNS = ("run_id", "principal", "status", "num_requests", "prompt_tokens", "cached_tokens", "retractions")
SUM_KEY = SUM_COLUMNS[:3]
LATENCY_COLUMNS = ("run_id", "principal", "latency", "bucket", "num_requests", "min_ms", "max_ms")
LATENCY_KEY = LATENCY_COLUMNS[:4]


def buckets_of(latency_ms: np.ndarray) -> np.ndarray:
    """The bucket of each latency (ms, finite, >= 0)."""
    scaled = np.maximum(latency_ms, FLOOR_MS) / FLOOR_MS
    found = np.floor(np.log2(scaled) * BUCKETS_PER_DOUBLING).astype(np.int64)
    return np.where(latency_ms < FLOOR_MS, -1, found)


def bucket_middle(bucket: np.ndarray) -> np.ndarray:
    """A bucket's geometric middle in ms (FLOOR_MS / 2 for bucket -1)."""
    middle = FLOOR_MS * np.exp2((bucket.astype(float) + 0.5) / BUCKETS_PER_DOUBLING)
    return np.where(bucket < 0, FLOOR_MS / 2, middle)


def sums_rows(run_id: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> tuple[list[Any], list[Any]]:
    """The request_sums and request_latencies rows (SUM_COLUMNS, LATENCY_COLUMNS order) of request rows in
    `columns` order: one per key present, to be added to what is stored."""
    if not rows:
        return [], []
    at = {name: i for i, name in enumerate(columns)}
    principals = [NO_PRINCIPAL if r[at["principal"]] is None else str(r[at["principal"]]) for r in rows]
    groups, codes = _codes([(p, str(r[at["status"]])) for p, r in zip(principals, rows, strict=True)])
    counts = np.bincount(codes, minlength=len(groups))
    totals = [
        np.bincount(codes, weights=_numbers(rows, at[name]), minlength=len(groups))
        for name in ("prompt_len", "cached_tokens", "num_retractions")
    ]
    sums = [(run_id, p, s, int(counts[i]), *(int(t[i]) for t in totals)) for i, (p, s) in enumerate(groups)]
    names, principal_codes = _codes(principals)
    latencies: list[Any] = []
    for latency, (end, start) in REQUEST_LATENCIES.items():
        with np.errstate(invalid="ignore"):
            delta = (_numbers(rows, at[end]) - _numbers(rows, at[start])) * 1000.0
        kept = np.isfinite(delta) & (delta >= 0)
        latencies += _histogram_rows(run_id, latency, names, principal_codes[kept], delta[kept])
    return sums, latencies


def _histogram_rows(
    run_id: int, latency: str, names: list[str], principal_codes: np.ndarray, latency_ms: np.ndarray
) -> list[Any]:
    if not len(latency_ms):
        return []
    buckets = buckets_of(latency_ms)
    keys, inverse = np.unique(np.stack([principal_codes, buckets]), axis=1, return_inverse=True)
    inverse = inverse.reshape(-1)
    counts = np.bincount(inverse, minlength=keys.shape[1])
    least = np.full(keys.shape[1], np.inf)
    most = np.full(keys.shape[1], -np.inf)
    np.minimum.at(least, inverse, latency_ms)
    np.maximum.at(most, inverse, latency_ms)
    return [
        (run_id, names[int(code)], latency, int(bucket), int(n), float(lo), float(hi))
        for code, bucket, n, lo, hi in zip(keys[0], keys[1], counts, least, most, strict=True)
    ]


def _codes(keys: list[Any]) -> tuple[list[Any], np.ndarray]:
    """The distinct keys in first-seen order, and each key's index among them."""
    index: dict[Any, int] = {}
    codes = np.fromiter((index.setdefault(k, len(index)) for k in keys), dtype=np.int64, count=len(keys))
    return list(index), codes


def _numbers(rows: Sequence[Sequence[Any]], i: int) -> np.ndarray:
    """Column i as floats (None: NaN)."""
    return np.fromiter((math.nan if r[i] is None else r[i] for r in rows), dtype=float, count=len(rows))


class Histogram:
    """One latency's histogram rows (any order, one row per bucket) as the order statistics they stand for:
    the k-th smallest latency is read as its bucket's middle, within the bucket's least and greatest value
    (so each bucket's first and last order statistics are exact)."""

    def __init__(self, buckets: np.ndarray, counts: np.ndarray, least: np.ndarray, most: np.ndarray) -> None:
        order = np.argsort(buckets, kind="stable")
        self.counts = np.asarray(counts, dtype=np.int64)[order]
        self.least = np.asarray(least, dtype=float)[order]
        self.most = np.asarray(most, dtype=float)[order]
        self.middle = np.clip(bucket_middle(np.asarray(buckets)[order]), self.least, self.most)
        self.ends = np.cumsum(self.counts)  # NOTE: bucket i holds order statistics [ends[i] - counts[i], ends[i])
        self.num_values = int(self.ends[-1]) if len(self.ends) else 0

    def value(self, k: int) -> float:
        """The k-th smallest latency (0-based), as read from the buckets."""
        i = int(np.searchsorted(self.ends, k, side="right"))
        if k == self.ends[i] - self.counts[i]:
            return float(self.least[i])
        return float(self.most[i]) if k == self.ends[i] - 1 else float(self.middle[i])

    def percentile(self, q: float) -> float:
        """np.percentile's linear interpolation between order statistics (q in 0..100); NaN without values."""
        if not self.num_values:
            return math.nan
        rank = q / 100.0 * (self.num_values - 1)
        k = math.floor(rank)
        low = self.value(k)
        return low if k + 1 >= self.num_values else low + (rank - k) * (self.value(k + 1) - low)

    def lowest_from(self, limit: float) -> float:
        """The smallest latency >= limit (as read): a box's lower whisker."""
        i = int(np.searchsorted(self.most, limit, side="left"))
        return float(self.least[i]) if self.least[i] >= limit else float(np.clip(self.middle[i], limit, self.most[i]))

    def highest_to(self, limit: float) -> float:
        """The largest latency <= limit (as read): a box's upper whisker."""
        i = int(np.searchsorted(self.least, limit, side="right")) - 1
        return float(self.most[i]) if self.most[i] <= limit else float(np.clip(self.middle[i], self.least[i], limit))
