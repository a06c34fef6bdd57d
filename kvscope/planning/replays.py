"""What-if replays without torch: their config, their result, and running several at once in
worker processes. The replay itself (a request stream through a real RadixCache) lives in
brute_force.py and loads torch; this module imports it only inside a worker, or in this
process when a caller asks for replays here, so `kvscope replay` never loads torch itself.

NOTE: conventions for `capacity` (how to read a replay's capacity beside the one-pass curve)
    "slots"  the pool has `capacity` slots, shared by the tree and the request in flight
             (bench_radix's protocol; SGLang's max_total_num_tokens at concurrency 1); a
             request longer than the pool is skipped
    "tree"   the tree may hold `capacity` tokens between requests: the pool has
             capacity + ceil_ps(longest request) slots, so the request in flight never
             evicts, and after it is inserted and unlocked the tree is evicted back to
             `capacity`. The one-pass curve (curve.py) is exact under this convention with
             eviction_granularity="page".
Peak usage = the most slots in use at once (tree + the request in flight, whole pages).

A scoped replay (`ReplayConfig.scoped` set) serves the same stream through the scoped radix
cache: each request's `user` is its principal, and the cache's clock is trace time
(requests.trace_times_s), so its epochs are the trace's, not the replay's wall time.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from kvscope.planning.requests import ReplayRequest

Convention = Literal["slots", "tree"]
Granularity = Literal["page", "leaf"]
CONVENTIONS: tuple[Convention, ...] = ("slots", "tree")
GRANULARITIES: tuple[Granularity, ...] = ("page", "leaf")
CONVENTION_MEANINGS: dict[str, str] = {
    "slots": "the pool holds CAPACITY slots, shared by the tree and the request in flight (bench_radix's "
    "protocol; SGLang's max_total_num_tokens at concurrency 1)",
    "tree": "the tree holds up to CAPACITY tokens between requests; the request in flight has its own headroom",
}
PROGRESS_TICK_S = 0.5
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def ceil_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size) * page_size


@dataclass(frozen=True)
class ScopedOptions:
    """The scoped radix cache's settings in a replay (kvscope.engine.CacheConfig's meanings):
    promote_k None never promotes; epoch_s in trace seconds; pinned prefixes as token ids."""

    promote_k: int | None = 3
    epoch_s: float = 60.0
    pinned: tuple[tuple[int, ...], ...] = ()
    dedup: bool = False
    merge_chains: bool = False

    def __post_init__(self) -> None:
        if self.promote_k is not None and (type(self.promote_k) is not int or self.promote_k < 1):
            raise ValueError(f"promote_k must be an int >= 1, or None for never; got {self.promote_k!r}")
        if not 0 < self.epoch_s < float("inf"):
            raise ValueError(f"epoch_s must be a finite number of seconds > 0, got {self.epoch_s!r}")

    def describe(self) -> str:
        """k=3, epoch 60 s, 2 pinned, dedup off"""
        k = "inf" if self.promote_k is None else str(self.promote_k)
        return f"k={k}, epoch {self.epoch_s:g} s, {len(self.pinned)} pinned, dedup {'on' if self.dedup else 'off'}" + (
            ", merged chains" if self.merge_chains else ""
        )


@dataclass(frozen=True)
class ReplayConfig:
    """One replay's settings. The eviction policy's name is checked where the replay builds its
    cache (the policy registry lives with the cache, which loads torch)."""

    capacity: int  # tokens; a multiple of page_size
    page_size: int = 1
    eviction_granularity: Granularity = "page"
    convention: Convention = "slots"
    eviction_policy: str = "lru"
    scoped: ScopedOptions | None = None  # None: the radix cache, global sharing

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page size must be a power of two >= 1, got {self.page_size}")
        if self.capacity < 0 or self.capacity % self.page_size:
            raise ValueError(f"capacity {self.capacity} must be >= 0 and a multiple of the page size {self.page_size}")
        if self.convention == "slots" and self.capacity < self.page_size:
            raise ValueError(f"a pool of {self.capacity} slots holds no page; the slots convention needs >= 1 page")
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {self.convention!r}")
        if self.eviction_granularity not in GRANULARITIES:
            raise ValueError(f"eviction granularity must be one of {GRANULARITIES}, got {self.eviction_granularity!r}")


class ReplayResult(NamedTuple):
    config: ReplayConfig
    request_hit_tokens: np.ndarray  # int64 per request; -1 for a skipped request
    num_prompt_tokens: int
    num_evicted_tokens: int
    peak_usage_tokens: int
    wall_s: float
    # per request, hit tokens in shared (not private) nodes another principal created; -1 skipped
    request_cross_hit_tokens: np.ndarray | None = None
    cache_stats: dict[str, Any] | None = None  # a scoped replay's ScopedStats at the end, as a dict

    @property
    def num_requests(self) -> int:
        return len(self.request_hit_tokens)

    @property
    def num_skipped(self) -> int:
        return int((self.request_hit_tokens < 0).sum())

    @property
    def num_hit_tokens(self) -> int:
        return int(self.request_hit_tokens[self.request_hit_tokens > 0].sum())

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / max(self.num_prompt_tokens, 1)

    @property
    def num_cross_hit_tokens(self) -> int:
        """Hit tokens served by nodes another principal created (the cross-principal reuse)."""
        cross = self.request_cross_hit_tokens
        return 0 if cross is None else int(cross[cross > 0].sum())


# -- several capacities in parallel ---------------------------------------------------------------

_worker_requests: list[ReplayRequest] = []


def _init_worker(sequences: list[tuple[int, np.ndarray, str | None, float | None]]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C is the parent's to handle
    import torch

    torch.set_num_threads(1)
    _worker_requests[:] = [
        ReplayRequest(str(i), ids[:n], ids, user, arrival_s) for i, (n, ids, user, arrival_s) in enumerate(sequences)
    ]


def _replay_in_worker(config: ReplayConfig) -> ReplayResult:
    from kvscope.planning.brute_force import replay

    return replay(_worker_requests, config)


def _terminate_workers(pool: cf.ProcessPoolExecutor) -> None:
    """NOTE: ProcessPoolExecutor has no public way to stop running workers before Python 3.14
    (terminate_workers); its private process table is the only handle."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


@contextlib.contextmanager
def _stop_signals_deferred() -> Iterator[None]:
    """Start workers with Ctrl-C held back. A started process inherits the signal mask of the
    thread that starts it, so with SIGINT blocked here no worker sees it while it imports,
    before its initializer ignores it (SIGTERM stays deliverable: it is how workers are ended).
    This process may still get SIGINT through another thread (numpy's, say), or SIGTERM or
    SIGHUP: each is recorded and the first raised again once the workers have started, so a
    start is never cut in half."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    received: list[int] = []
    handlers = {
        signum: signal.signal(signum, lambda signum, _frame: received.append(signum)) for signum in STOP_SIGNALS
    }
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if received:
            signal.raise_signal(received[0])


def replay_many(
    requests: Sequence[ReplayRequest],
    configs: Sequence[ReplayConfig],
    max_workers: int | None = None,
    on_done: Callable[[int, int], None] | None = None,
    *,
    always_spawn: bool = False,
) -> list[ReplayResult]:
    """One replay per config, in worker processes (at most os.cpu_count(), one per config);
    results in the order of `configs`. `on_done(num_done, num_total)` after each one finishes
    and every PROGRESS_TICK_S while they run. With one worker (or one config) the replays run
    in this process (which then loads torch) unless `always_spawn`. Workers are spawned (not
    forked: the parent may hold torch and threads), so a script that calls this needs the
    `if __name__ == "__main__":` guard. Ctrl-C stops every worker quietly and raises
    KeyboardInterrupt here."""
    num_workers = min(len(configs), max_workers or os.cpu_count() or 1, os.cpu_count() or 1)
    if num_workers <= 1 and not always_spawn:
        return _replay_here(requests, configs, on_done)
    results: list[ReplayResult | None] = [None] * len(configs)
    sequences = [(r.prompt_len, r.all_ids, r.user, r.arrival_s) for r in requests]
    # NOTE: spawn, not fork: the parent may have torch loaded, and a forked child of a process
    # with OpenMP threads can hang; the request stream goes to each worker once
    context = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(
        max(num_workers, 1), mp_context=context, initializer=_init_worker, initargs=(sequences,)
    )
    try:
        with _stop_signals_deferred():
            futures = {pool.submit(_replay_in_worker, config): k for k, config in enumerate(configs)}
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=PROGRESS_TICK_S, return_when=cf.FIRST_COMPLETED)
            for future in done:
                results[futures[future]] = future.result()
            if on_done:
                on_done(len(configs) - len(pending), len(configs))
    except BaseException:  # NOTE: Ctrl-C or a failed replay: start no more, end the running ones
        pool.shutdown(wait=False, cancel_futures=True)
        _terminate_workers(pool)
        raise
    pool.shutdown()
    return [r for r in results if r is not None]


def _replay_here(
    requests: Sequence[ReplayRequest], configs: Sequence[ReplayConfig], on_done: Callable[[int, int], None] | None
) -> list[ReplayResult]:
    from kvscope.planning.brute_force import replay

    results = []
    for config in configs:
        results.append(replay(requests, config))
        if on_done:
            on_done(len(results), len(configs))
    return results
