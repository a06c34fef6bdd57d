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
from collections.abc import Mapping, Sequence
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
    by_name = dict(zip(columns, zip(*rows, strict=True), strict=True))  # NOTE: the batch's columns, by name
    principals = [NO_PRINCIPAL if p is None else str(p) for p in by_name["principal"]]
    groups, codes = _codes(list(zip(principals, map(str, by_name["status"]), strict=True)))
    counts = np.bincount(codes, minlength=len(groups))
    totals = [
        np.bincount(codes, weights=_numbers(by_name[name]), minlength=len(groups))
        for name in ("prompt_len", "cached_tokens", "num_retractions")
    ]
    sums = [(run_id, p, s, int(counts[i]), *(int(t[i]) for t in totals)) for i, (p, s) in enumerate(groups)]
    names, principal_codes = _codes(principals)
    return sums, _histogram_rows(run_id, names, principal_codes, [_latency_ms(by_name, span) for span in SPANS])


SPANS = tuple(REQUEST_LATENCIES.values())
LATENCY_NAMES = tuple(REQUEST_LATENCIES)
BUCKET_SPAN = 1 << 32  # NOTE: a key packs (latency, principal code, bucket + 1) into one int64


def _latency_ms(by_name: Mapping[str, Sequence[Any]], span: tuple[str, str]) -> np.ndarray:
    """One latency of each request in ms; NaN where it does not count (a moment missing, end before start)."""
    with np.errstate(invalid="ignore"):
        delta = (_numbers(by_name[span[0]]) - _numbers(by_name[span[1]])) * 1000.0
    return np.where(delta >= 0, delta, np.nan)


def _histogram_rows(
    run_id: int, names: list[str], principal_codes: np.ndarray, latency_ms: list[np.ndarray]
) -> list[Any]:
    """One sort over every (latency, principal, bucket) key of the batch; per key its count, least, greatest."""
    values = np.concatenate(latency_ms)
    which = np.repeat(np.arange(len(latency_ms), dtype=np.int64), len(principal_codes))
    codes = np.tile(principal_codes, len(latency_ms))
    kept = np.isfinite(values)
    values, which, codes = values[kept], which[kept], codes[kept]
    if not len(values):
        return []
    keys = (which * len(names) + codes) * BUCKET_SPAN + (buckets_of(values) + 1)
    order = np.lexsort((values, keys))  # NOTE: by key, then value: a run's first and last are its least and greatest
    keys, values = keys[order], values[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    ends = np.append(starts[1:], len(keys)) - 1
    firsts = keys[starts]
    group, bucket = np.divmod(firsts, BUCKET_SPAN)
    latency, code = np.divmod(group, len(names))
    return list(
        zip(
            [run_id] * len(starts),
            [names[c] for c in code.tolist()],
            [LATENCY_NAMES[w] for w in latency.tolist()],
            (bucket - 1).tolist(),
            (ends - starts + 1).tolist(),
            values[starts].tolist(),
            values[ends].tolist(),
            strict=True,
        )
    )


def _codes(keys: list[Any]) -> tuple[list[Any], np.ndarray]:
    """The distinct keys in first-seen order, and each key's index among them."""
    index: dict[Any, int] = {}
    codes = np.fromiter((index.setdefault(k, len(index)) for k in keys), dtype=np.int64, count=len(keys))
    return list(index), codes


def _numbers(column: Sequence[Any]) -> np.ndarray:
    """A column as floats (None: NaN)."""
    return np.array(column, dtype=float)


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
