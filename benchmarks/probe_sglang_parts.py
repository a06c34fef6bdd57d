"""Where the SGLang probe's in-situ cost per paged allocator call goes at level full, part by part, on
SGLang 0.5.23's real PagedTokenToKVPoolAllocator (bench_probe_sglang.py's allocator round: alloc(16) +
the free of it, 2 calls a round, then the per-step check).

    PYTHONPATH=. KVSCOPE_PYTHON=.venv/bin/python ~/.cache/kvscope/sglang-venv/bin/python -W ignore \\
        benchmarks/probe_sglang_parts.py [--blocks N]

Variants, each the previous one plus one part (all patched directly on the class, as the probe does):
    plain       SGLang's methods
    wrapper     a method in SGLang's place that calls it and reads what the probe's hook reads
    append      + the probe's queue append, the queue emptied at once (nothing kept)
    keep        + the queue kept until FOLD_CALLS entries, then emptied (the tensors freed in bulk)
    keep, no gc the same with Python's cyclic GC off for the block (what the kept objects cost the GC)
    full, inline fold   the probe's hooks and, when a fold is due, its drain on the engine thread (the
                fold as it ran before this round, and as a census runs it)
    full        the probe's hooks and its per-step fold_if_due (the fold on the ledger's worker thread;
                the block's end waits for it, so its CPU is in the block's process figure)
(the recorder's hand-off to its host is not timed: it runs at each block's end)
Blocks of BLOCK_ROUNDS rounds, the variants in a new shuffled order each repetition; per variant the
median of its blocks' paired differences to plain (engine-thread CPU, time.thread_time), with their
middle half; the process CPU (time.process_time) beside it. Per call: the engine thread's CPU in the
per-step fold (thread_time around each: the whole fold inline, the take alone with the worker), and
the GC collections by generation and their CPU (gc.callbacks, on whichever thread collected).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_probe_sglang as bench  # NOTE: SGLang stand-ins installed, SGLang imported
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

from kvscope.probe import sglang as probe
from kvscope.probe import sglang_hooks
from kvscope.probe.core import settings_from_env
from kvscope.probe.sglang_ledger import ALLOC, FIELDS, FOLD_CALLS, FREE

BLOCK_ROUNDS = 400
VARIANTS = ("plain", "wrapper", "append", "keep", "keep, no gc", "full, inline fold", "full")


class GcClock:
    """Python's cyclic GC collections and their thread CPU, per generation, while on."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.cpu_ns = [0, 0, 0]
        self.began = 0
        gc.callbacks.append(self.tick)

    def tick(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.began = time.thread_time_ns()
        else:
            self.count[info["generation"]] += 1
            self.cpu_ns[info["generation"]] += time.thread_time_ns() - self.began

    def take(self) -> tuple[list[int], list[int]]:
        out = (self.count, self.cpu_ns)
        self.count, self.cpu_ns = [0, 0, 0], [0, 0, 0]
        return out


def variants(plain: dict[str, Any], fold: FoldClock) -> dict[str, tuple[dict[str, Any], Callable[[], None]]]:
    """variant -> (the methods to put on the allocator class, the per-round step)."""
    p = probe.PROBE
    pending = p.pending
    sglang_alloc, sglang_release = plain["alloc"], plain["_release_page_ids"]

    def wrap(keep: Callable[[Any, Any, int], None] | None) -> dict[str, Any]:
        def alloc(self: Any, need_size: int) -> Any:
            out = sglang_alloc(self, need_size)
            q = p
            if out is not None and q.state.active and q.hot and keep is not None:
                keep(self, out, ALLOC)
            return out

        def release(self: Any, *page_ids: Any) -> Any:
            q = p
            if q.state.active and q.hot:
                for ids in page_ids:
                    if keep is not None:
                        keep(self, ids, FREE)
            return sglang_release(self, *page_ids)

        return {"alloc": alloc, "_release_page_ids": release}

    def read_only(self: Any, out: Any, kind: int) -> None:
        (kind, self, p.rid, p.step, p.event, out, None)  # noqa: B018  # NOTE: the reads, no append

    def append_drop(self: Any, out: Any, kind: int) -> None:
        pending.extend((kind, self, p.rid, p.step, p.event, out, None))
        pending.clear()

    def append_keep(self: Any, out: Any, kind: int) -> None:
        pending.extend((kind, self, p.rid, p.step, p.event, out, None))

    def drop_when_full() -> None:
        if len(pending) >= FOLD_CALLS * FIELDS:
            pending.clear()

    hooks = {
        "alloc": sglang_hooks._d_alloc(sglang_alloc),
        "_release_page_ids": sglang_hooks._d_release_pages(sglang_release),
    }
    return {
        "plain": (plain, lambda: None),
        "wrapper": (wrap(read_only), lambda: None),
        "append": (wrap(append_drop), lambda: None),
        "keep": (wrap(append_keep), drop_when_full),
        "keep, no gc": (wrap(append_keep), drop_when_full),
        "full, inline fold": (hooks, fold.inline),
        "full": (hooks, fold.step),
    }


class FoldClock:
    """The probe's per-step fold_if_due, with the thread CPU of the folds it runs summed."""

    def __init__(self) -> None:
        self.cpu_ns = 0
        self.folds = 0

    def step(self) -> None:
        p = probe.PROBE
        now = time.monotonic()
        if p.ledger.due(now) or p.ledger.blocks:
            start = time.thread_time_ns()
            p.fold_if_due(now)
            self.cpu_ns += time.thread_time_ns() - start
            self.folds += 1

    def inline(self) -> None:
        p = probe.PROBE
        if p.ledger.due(time.monotonic()):
            start = time.thread_time_ns()
            p.drain()
            self.cpu_ns += time.thread_time_ns() - start
            self.folds += 1

    def take(self) -> tuple[int, int]:
        out = (self.cpu_ns, self.folds)
        self.cpu_ns, self.folds = 0, 0
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blocks", type=int, default=121, help="repetitions of each variant's block")
    args = parser.parse_args()
    os.environ.setdefault("KVSCOPE_CAPTURE", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"parts-{os.getpid()}.db"))
    os.environ["KVSCOPE_LEVEL"] = "full"  # NOTE: what it takes apart (SGLang's default is summary)
    probe.PROBE.__init__(settings_from_env(engine="sglang"), "0.5.23")
    probe.PROBE.state.active = True
    assert probe.PROBE.recorder() is not None, "the probe did not open its recorder"
    cls = PagedTokenToKVPoolAllocator
    plain = {name: cls.__dict__[name] for name in ("alloc", "_release_page_ids")}
    fold_clock = FoldClock()
    made = variants(plain, fold_clock)
    alloc, _ = bench.build()
    gc_clock = GcClock()
    thread_us: dict[str, list[float]] = {v: [] for v in VARIANTS}
    process_us: dict[str, list[float]] = {v: [] for v in VARIANTS}
    gcs: dict[str, list[tuple[list[int], list[int]]]] = {v: [] for v in VARIANTS}
    folds: dict[str, list[tuple[int, int]]] = {"full": [], "full, inline fold": []}
    order = random.Random(0)
    calls = 2 * BLOCK_ROUNDS
    load = os.getloadavg()[0]
    for _ in range(args.blocks):
        for name in order.sample(VARIANTS, len(VARIANTS)):
            methods, step = made[name]
            for method, fn in methods.items():
                setattr(cls, method, fn)
            if name == "keep, no gc":
                gc.disable()
            gc_clock.take()
            fold_clock.take()
            start, start_p = time.thread_time_ns(), time.process_time_ns()
            bench.allocator_round(alloc, step, BLOCK_ROUNDS)
            end = time.thread_time_ns()
            bench.settle(probe.PROBE)
            thread_us[name].append((end - start) / calls / 1e3)
            process_us[name].append((time.process_time_ns() - start_p) / calls / 1e3)
            gc.enable()
            gcs[name].append(gc_clock.take())
            if name in folds:
                folds[name].append(fold_clock.take())
                probe.PROBE.drain()  # NOTE: what is left folds (and hands over) here, untimed
                probe.PROBE.state.recorder.idle()
            probe.PROBE.pending.clear()
    for method, fn in plain.items():
        setattr(cls, method, fn)
    print(f"load {load:.1f} -> {os.getloadavg()[0]:.1f}; {args.blocks} blocks of {BLOCK_ROUNDS} rounds a variant")
    print(
        f"{'variant':<12} {'thread µs/call':>14} {'added':>7} {'(middle half)':>18} {'process added':>14} gc/1k calls"
    )
    for name in VARIANTS:
        low, mid, high = statistics.quantiles(
            [m - b for m, b in zip(thread_us[name], thread_us["plain"], strict=True)], n=4
        )
        proc = statistics.median(m - b for m, b in zip(process_us[name], process_us["plain"], strict=True))
        counts = [sum(c[i] for c, _ in gcs[name]) * 1000 / (calls * args.blocks) for i in range(3)]
        gc_ns = sum(sum(ns) for _, ns in gcs[name]) / (calls * args.blocks)
        print(
            f"{name:<12} {statistics.median(thread_us[name]):14.2f} {mid:+7.2f} ({low:+.2f} to {high:+.2f}) "
            f"{proc:+14.2f} {'/'.join(f'{c:.2f}' for c in counts)} ({gc_ns:.0f} ns/call)"
        )
    for name, taken in folds.items():
        fold_ns = sum(ns for ns, _ in taken) / (calls * args.blocks)
        each_us = sum(ns for ns, _ in taken) / max(sum(n for _, n in taken), 1) / 1e3
        print(f"{name}: the engine thread's per-step fold work {fold_ns:.0f} ns per call ({each_us:.0f} µs a time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
