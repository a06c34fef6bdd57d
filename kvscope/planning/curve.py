"""Hit rate vs cache capacity for a request stream, from one pass (stack distances, docs/capacity-planning.md §6-§9).

Capacity convention (the one under which the curve is exact): `capacity` is the number of
tokens the radix tree may hold between requests, floored to whole pages. The request being
served does not count against it: its new slots come from headroom, and the tree is evicted
back to `capacity` once the request is inserted and unlocked. Under that convention the curve
equals, request by request and at every capacity, a replay through
`RadixCache(eviction_granularity="page")` with LRU (see `brute_force.replay` with convention="tree").

Under the slot convention of benchmarks/bench_radix.py (a pool of C slots that the request in
flight shares with the tree) a replay's tree holds between C minus the largest in-flight need
and C tokens when a request arrives, so its hit tokens lie between the curve at those two
capacities. SGLang's whole-leaf eviction (the default `eviction_granularity="leaf"`) may evict
more than needed; the curve does not model it, and replays report the gap.

Why page mode: SGLang's RadixCache stamps the unmatched lower half of a node that a match or an
insert splits as just accessed, so that half can outlive younger leaves, which no recency order
over tokens describes. kvscope's page-granular mode keeps that half's access time, which is what
makes the curve exact there.

Pure: numpy only (no torch), so the dashboard can import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, overload

import numpy as np

from kvscope.planning.requests import ReplayRequest
from kvscope.planning.stack_distance import Ramps, stack_distance_ramps

EXACTNESS = (
    "exact for page-granular LRU tail eviction, tree-capacity convention (tokens the radix tree holds "
    "between requests; the request in flight not counted)"
)


@dataclass(frozen=True, eq=False)
class HitRateCurve:
    """Prompt tokens served from the cache at every capacity.

    `ramps` hold the piecewise-linear curve: hit_tokens(K) = Σ clamp(K - start, 0, length).
    `prompt_lens` are whole prompts (the hit rate's denominator); hits count whole pages only.
    """

    page_size: int
    prompt_lens: np.ndarray  # int64, per request
    ramps: Ramps
    # NOTE: sorted ramp starts and ends with their prefix sums ([0, ...], one longer)
    _starts: np.ndarray = field(init=False, repr=False)
    _ends: np.ndarray = field(init=False, repr=False)
    _start_sums: np.ndarray = field(init=False, repr=False)
    _end_sums: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = np.sort(self.ramps.start)
        ends = np.sort(self.ramps.start + self.ramps.length)
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_ends", ends)
        object.__setattr__(self, "_start_sums", np.concatenate(([0], np.cumsum(starts))))
        object.__setattr__(self, "_end_sums", np.concatenate(([0], np.cumsum(ends))))

    # -- totals ----------------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_lens.sum())

    @property
    def working_set_tokens(self) -> int:
        """Tokens of every path ever inserted: no capacity beyond it changes anything."""
        return self.ramps.num_tokens_in_trie

    @property
    def saturation_tokens(self) -> int:
        """The smallest capacity that reaches the infinite-cache hit rate."""
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def max_hit_tokens(self) -> int:
        """Hits with an unbounded cache; the rest of the prompt tokens are compulsory misses."""
        return int(self.ramps.length.sum())

    @property
    def max_hit_rate(self) -> float:
        return self.max_hit_tokens / max(self.num_prompt_tokens, 1)

    # -- the curve -------------------------------------------------------------------------------

    @overload
    def hit_tokens(self, capacity: int) -> int: ...
    @overload
    def hit_tokens(self, capacity: np.ndarray) -> np.ndarray: ...

    def hit_tokens(self, capacity: int | np.ndarray) -> int | np.ndarray:
        """Prompt tokens hit over the whole stream with a tree of `capacity` tokens (page-floored)."""
        k = np.asarray(capacity, dtype=np.int64) // self.page_size * self.page_size
        if np.any(k < 0):
            raise ValueError(f"capacity must be >= 0, got {np.min(k)}")
        num_started = np.searchsorted(self._starts, k, side="left")
        num_ended = np.searchsorted(self._ends, k, side="left")
        hits = (num_started * k - self._start_sums[num_started]) - (num_ended * k - self._end_sums[num_ended])
        return int(hits) if np.ndim(hits) == 0 else hits

    @overload
    def hit_rate(self, capacity: int) -> float: ...
    @overload
    def hit_rate(self, capacity: np.ndarray) -> np.ndarray: ...

    def hit_rate(self, capacity: int | np.ndarray) -> float | np.ndarray:
        """Token hit rate: hit tokens / prompt tokens."""
        hits = self.hit_tokens(capacity)
        return hits / max(self.num_prompt_tokens, 1)

    def request_hit_tokens(self, capacity: int) -> np.ndarray:
        """Per request, the prompt tokens hit with a tree of `capacity` tokens (int64)."""
        k = int(capacity) // self.page_size * self.page_size
        per_ramp = np.clip(k - self.ramps.start, 0, self.ramps.length)
        return np.bincount(self.ramps.request, weights=per_ramp, minlength=self.num_requests).astype(np.int64)

    def breakpoints(self) -> tuple[np.ndarray, np.ndarray]:
        """(capacities, hit tokens) at every point where the curve's slope changes, from 0 to
        saturation; the curve is linear in between (page size 1) or steps per page."""
        capacities = np.unique(np.concatenate(([0], self._starts, self._ends)))
        return capacities, self.hit_tokens(capacities)

    def log_grid(self, num_points: int = 12, low_fraction: float = 0.01) -> np.ndarray:
        """Page-aligned capacities, log-spaced from low_fraction of the working set to all of it
        (docs/capacity-planning.md §8)."""
        top = max(self.working_set_tokens, self.page_size)
        grid = np.geomspace(max(top * low_fraction, self.page_size), top, num_points)
        return np.unique(np.ceil(grid / self.page_size).astype(np.int64) * self.page_size)


def one_pass_curve(requests: Sequence[ReplayRequest], page_size: int = 1, *, isolated: bool = False) -> HitRateCurve:
    """The hit-rate curve of `requests` at every capacity, from one pass (see the module doc).
    `isolated`: keys namespaced by each request's `user` (None is one principal of its own), so
    no two principals share a node: the curve of per-principal isolation (scoped radix cache
    with k = inf, no pinned prefixes, dedup off) under the same shared capacity."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    namespaces = [r.user for r in requests] if isolated else None
    ramps = stack_distance_ramps(((r.prompt_len, r.all_ids) for r in requests), page_size, namespaces)
    prompt_lens = np.fromiter((r.prompt_len for r in requests), dtype=np.int64, count=len(requests))
    return HitRateCurve(page_size, prompt_lens, ramps)


# -- which curve describes a run's cache -----------------------------------------------------------

Sharing = Literal["global", "isolated"]
SHARING_NAMES: dict[str, str] = {"global": "global sharing", "isolated": "per-principal isolation"}


class CacheCurves(NamedTuple):
    """The one-pass curves drawn for a captured run's cache, and one line saying what they assume."""

    sharing: tuple[Sharing, ...]  # `isolated`: one_pass_curve(..., isolated=True); the first is read for a target
    assumption: str


def cache_curves(config: Mapping[str, Any]) -> CacheCurves:
    """From a run's config fingerprint (keys engine.cache, model.sliding_window): the curves that
    describe its cache's sharing rule, or, where no one-pass curve does, global sharing with the
    rule named. NOTE: the isolated curve is exact only for k = inf with no pinned prefixes and
    dedup off (docs/capacity-planning.md §11); a finite k is not a stack algorithm."""
    cache = _mapping(_mapping(config).get("engine")).get("cache")
    cache = _mapping(cache)
    kind = str(cache.get("kind", "radix"))
    if kind == "scoped-radix":
        return _scoped_curves(cache)
    if kind == "swa-radix":
        window = _mapping(_mapping(config).get("model")).get("sliding_window")
        last = f"the last {window} tokens" if isinstance(window, int) else "the sliding window"
        return CacheCurves(
            ("global",),
            "The curve models the full-attention pool alone, with global sharing; this "
            f"run's SWA radix cache also needs {last} of a matched prefix in its smaller SWA pool, "
            "which evicts on its own (a tombstone keeps only the full KV), so the run can hit less "
            "at the same capacity.",
        )
    if kind == "hiradix":
        return CacheCurves(
            ("global",),
            "The curve models one tier with global sharing; this run's hiradix cache "
            "also serves hits from its host tier (copies loaded back), which the curve does not model.",
        )
    if kind in ("chunk", "none"):
        return CacheCurves(
            ("global",),
            f"This run's {kind} cache keeps no prefix across requests (its hit rate is "
            "0 at any capacity); the curve is what a radix cache with global sharing would hit.",
        )
    return CacheCurves(
        ("global",), "Global sharing, as this run's radix cache: any request reuses any cached prefix, all in one pool."
    )


def _scoped_curves(cache: Mapping[str, Any]) -> CacheCurves:
    promote_k, epoch_s = cache.get("promote_k", 3), cache.get("epoch_s", 60.0)
    pinned, dedup = len(cache.get("pinned") or ()), bool(cache.get("dedup"))
    if promote_k is None and not pinned and not dedup:
        return CacheCurves(
            ("isolated",),
            "Per-principal isolation, as this run's scoped cache (never promotes, no "
            "pinned prefixes, dedup off): a prefix is reused only by the user who computed it.",
        )
    rule = (
        "never shares a prefix across users"
        if promote_k is None
        else f"shares a prefix across users once {promote_k} of them computed it within the promotion window "
        f"(epochs of {epoch_s:g} s)"
    )
    extras = [f"{pinned} pinned prefix(es) shared from the start"] if pinned else []
    extras += ["dedup on"] if dedup else []
    k = "inf" if promote_k is None else str(promote_k)
    return CacheCurves(
        ("global", "isolated"),
        f"This run's scoped cache {rule}{', with ' if extras else ''}"
        f"{' and '.join(extras)}: no one-pass curve follows that rule; the two drawn are global sharing "
        "(every prefix shared) and per-principal isolation (none shared). `kvscope replay CAPTURE "
        f"--cache scoped-radix --promote-k {k} --epoch-s {epoch_s:g}` replays the rule itself.",
    )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
