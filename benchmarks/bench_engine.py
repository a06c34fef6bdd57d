"""The engine end to end on the tiny model: throughput, where the wall time goes, and what recording costs.

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--device auto|cpu|cuda|both] [--repeats N]
                                                 [--no-keep-freed-memory] [--no-write]

Prints Markdown tables; with --write (the default) also sets its rows in the `## bench_engine`
table of benchmarks/RESULTS.md. `--device auto` is `both` (CPU, then CUDA) where a GPU is present,
else `cpu`. One torch intra-op thread throughout (`torch.set_num_threads(1)`).

NOTE: cases; all requests arrive at once, the model is MODEL_PRESETS["tiny"] (float32)
    shared-prefix, multi-turn  the workloads with their default options, on `kvscope run`'s
                 default engine (KV 4096 tokens, 32 request rows, prefill chunks of 256,
                 context 2048, page size 1, radix cache, LRU): prefix hits and evictions
    decode-256   the `random` workload, 256 requests with prompts of ~16 tokens and long
                 outputs, 256 request rows and KV for all of them: one decode batch of 256
NOTE: what is timed; every run builds a fresh Engine (model, pools, cache) and, for a
recorded level, a fresh SQLRecorder in its own temporary directory, both untimed; each
phase runs every case once untimed first (warm-up)
    run     engine.run(requests): from the first request submitted to the last one finished
    close   recorder.close(): the last hand-off, the writer process writing it and exiting, the
            run marked finished; the capture is complete only then, so `total` = run + close
    malloc  phase 1, glibc's malloc as the process started: MALLOC_RUNS runs at off, with
            their minor page faults. Then (unless --no-keep-freed-memory) MALLOPT_SETTINGS for
            everything after: without them glibc hands the model's freed temporaries back to
            the kernel and the next forward faults them in again (hundreds of thousands of
            faults per run on CPU, up to half the run, and most of its run-to-run spread)
    levels  `repeats` rounds; a round runs off, summary and full, in an order rotated by one
            each round; a recorded run also counts the CPU time of the recorder's writer
            process over run and close (its start, while the engine is built, is untimed)
    split   one more run at off and one at full with timing shims (TimeSplit): the exclusive
            time on the caller's thread in the model's forward, memory management (every
            public method of the MemorySystem, its allocator, cache and req_to_token pool),
            the recorder's methods, and the rest (the scheduler's and the stats' Python)
After every run the engine must have finished every request with every idle leak check
passed, and a capture must be marked finished, hold one usage row per step and, at full, the
same number of events as every other full run of the case.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import inspect
import os
import resource
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch
from _results import Figure, command_line, machine, this_run, write_figures

from kvscope.app import to_engine_requests
from kvscope.engine.config import EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.stats import EngineStats
from kvscope.telemetry import NULL_RECORDER, Recorder
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.workloads import TraceRequest, generate

MODEL = MODEL_PRESETS["tiny"]
DEFAULT_REPEATS = 7
QUICK_REPEATS = 3
MALLOC_RUNS = 3
TARGET_OVERHEAD = 0.03  # issue 18: full vs off, wall and CPU time
BUSY_LOAD_AVERAGE = 1.5  # 1-minute load average; the benchmark itself keeps about one core busy
CATEGORIES = ("model", "memory", "recorder", "rest")
RUN_DEFAULT_POOL = PoolConfig(kv_size_tokens=4096, max_running_requests=32, max_context_len=2048)
DECODE_POOL = PoolConfig(kv_size_tokens=131_072, max_running_requests=256, max_context_len=2048)
M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3  # glibc mallopt parameters
MALLOPT_SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 64 << 20))  # 32 MiB: glibc's largest threshold
MALLOPT_TEXT = "mallopt(M_MMAP_THRESHOLD, 32 MiB) and mallopt(M_TOP_PAD, 64 MiB)"


class Case(NamedTuple):
    name: str
    workload: str
    num_requests: int
    options: dict[str, Any]
    pool: PoolConfig

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options.items()) or "default options"
        return f"`{self.workload}`, {self.num_requests} requests, {options}"


def cases(device_type: str, quick: bool) -> list[Case]:
    """Sizes that take a few seconds per run on a 2-core CPU; longer decodes on CUDA."""
    scale = 2 if quick else 1
    decode_output_len = (256 if device_type == "cuda" else 64) // scale
    return [
        Case("shared-prefix", "shared-prefix", 600 // scale, {}, RUN_DEFAULT_POOL),
        Case("multi-turn", "multi-turn", 500 // scale, {}, RUN_DEFAULT_POOL),
        Case("decode-256", "random", 256, {"prompt_len": 16, "output_len": decode_output_len}, DECODE_POOL),
    ]


LEVELS = ("off", "summary", "full")


class Timing(NamedTuple):
    run_s: float
    close_s: float
    cpu_s: float  # CPU time (user + system) over run and close: this process and the recorder's writer process
    num_page_faults: int  # minor page faults of the process during the run
    writer_cpu_s: float  # CPU time of the recorder's writer process over run and close (0 at off)

    @property
    def total_s(self) -> float:
        return self.run_s + self.close_s


class Outcome(NamedTuple):
    timing: Timing
    stats: EngineStats
    num_steps: int
    num_events: int


# -- the time split ------------------------------------------------------------------------


class TimeSplit:
    """Exclusive wall time per category on the thread that made it.

    NOTE: a shim switches the running category on entry and back on exit. A call made while
    its own category already runs (the cache calling the allocator, record() calling flush())
    passes straight through, so only the outermost call of a category is timed and counted;
    a call into another category (the allocator calling record()) pauses the outer one. Time
    outside every shim is `rest`. Calls from other threads (the recorder's writer) pass through.
    """

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.calls = dict.fromkeys(CATEGORIES, 0)  # outermost calls, timed
        self.num_nested_calls = [0]  # calls that passed through
        self._stack = ["rest"]
        self._since = [0.0]
        self._thread = threading.get_ident()

    def instrument(self, engine: Engine) -> None:
        memory = engine.memory
        for part in (memory, memory.allocator, memory.cache, memory.req_to_token_pool):
            for name, attr in inspect.getmembers_static(type(part)):
                if not name.startswith("_") and inspect.isfunction(attr):
                    setattr(part, name, self.shim("memory", getattr(part, name)))
        # NOTE: export_nodes runs only to feed the recorder's tree snapshots
        memory.cache.export_nodes = self.shim("recorder", type(memory.cache).export_nodes.__get__(memory.cache))
        engine.model.forward = self.shim("model", engine.model.forward, self.sync)
        recorder = engine.recorder
        if recorder is not NULL_RECORDER:
            for name in ("record", "usage", "leak_check", "request", "tree_snapshot", "flush"):
                setattr(recorder, name, self.shim("recorder", getattr(recorder, name)))

    def shim(
        self, category: str, fn: Callable[..., Any], after: Callable[[], None] | None = None
    ) -> Callable[..., Any]:
        seconds, calls, stack, since, thread = self.seconds, self.calls, self._stack, self._since, self._thread
        nested, clock, get_ident = self.num_nested_calls, time.perf_counter, threading.get_ident

        def timed(*args: Any, **kwargs: Any) -> Any:
            if stack[-1] == category or get_ident() != thread:
                nested[0] += 1
                return fn(*args, **kwargs)
            now = clock()
            seconds[stack[-1]] += now - since[0]
            since[0] = now
            stack.append(category)
            calls[category] += 1
            try:
                result = fn(*args, **kwargs)
                if after is not None:
                    after()
                return result
            finally:
                now = clock()
                seconds[category] += now - since[0]
                since[0] = now
                stack.pop()

        return timed

    def start(self) -> None:
        self._since[0] = time.perf_counter()

    def stop(self) -> None:
        assert self._stack == ["rest"], self._stack
        self.seconds["rest"] += time.perf_counter() - self._since[0]


def shim_costs_s(num_calls: int = 200_000) -> tuple[float, float]:
    """Seconds a shim adds to one call: (outermost, passed through); best of three."""
    split = TimeSplit(lambda: None)

    def noop() -> None:
        pass

    outer = split.shim("memory", noop)
    nested = split.shim("memory", noop)  # timed below with "memory" already running

    def per_call(fn: Callable[[], None]) -> float:
        start_s = time.perf_counter()
        for _ in range(num_calls):
            fn()
        return (time.perf_counter() - start_s) / num_calls

    base = min(per_call(noop) for _ in range(3))
    outer_s = min(per_call(outer) for _ in range(3)) - base
    split._stack.append("memory")
    nested_s = min(per_call(nested) for _ in range(3)) - base
    return outer_s, nested_s


# -- one run -------------------------------------------------------------------------------


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def keep_freed_memory() -> bool:
    """Apply MALLOPT_SETTINGS (glibc); False where there is no mallopt or it refused one."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in MALLOPT_SETTINGS)


def engine_config(case: Case, device: torch.device) -> EngineConfig:
    return EngineConfig(pool=case.pool, scheduler=SchedulerConfig(chunked_prefill_size=256), device=device.type)


def open_recorder(level: str, tmp_dir: Path, label: str) -> Recorder:
    if level == "off":
        return NULL_RECORDER
    recorder = SQLRecorder(tmp_dir / "capture.db", level=level, label=label)
    recorder.wait_ready()  # NOTE: the writer process's start is construction, untimed as the engine's
    return recorder


def writer_cpu_s(recorder: Recorder) -> float:
    """CPU seconds the recorder's writer process has used so far (0 for no writer)."""
    pid = getattr(recorder, "writer_pid", None)
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/schedstat") as fh:  # NOTE: Linux; the first field is ns on a CPU
        return int(fh.read().split()[0]) / 1e9


def children_cpu_s() -> float:
    """CPU seconds of this process's ended and waited-for children (a closed recorder's writer)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(
    case: Case, trace: list[TraceRequest], device: torch.device, level: str, split: TimeSplit | None = None
) -> Outcome:
    sync = synchronizer(device)
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="bench_engine-") as tmp:
        children_s = children_cpu_s()
        recorder = open_recorder(level, Path(tmp), case.name)
        engine = Engine(engine_config(case, device), MODEL, recorder)
        requests = to_engine_requests(trace)
        if split is not None:
            split.instrument(engine)
        sync()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        writer_start_s, cpu_s, start_s = writer_cpu_s(recorder), time.process_time(), time.perf_counter()
        if split is not None:
            split.start()
        stats = engine.run(requests)
        sync()
        if split is not None:
            split.stop()
        ran_s = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        recorder.close()
        closed_s, cpu_s = time.perf_counter(), time.process_time() - cpu_s
        writer_s = children_cpu_s() - children_s - writer_start_s if level != "off" else 0.0
        check_stats(case, stats, len(requests))
        num_events = check_capture(Path(tmp) / "capture.db", engine.scheduler.step) if level != "off" else 0
    timing = Timing(ran_s - start_s, closed_s - ran_s, cpu_s + writer_s, faults, writer_s)
    return Outcome(timing, stats, engine.scheduler.step, num_events)


def check_stats(case: Case, stats: EngineStats, num_requests: int) -> None:
    if stats.num_finished != num_requests or stats.leak_checks_failed or not stats.leak_checks_passed:
        raise AssertionError(
            f"{case.name}: {stats.num_finished}/{num_requests} finished, leak checks "
            f"{stats.leak_checks_passed} passed, {stats.leak_checks_failed} failed"
        )


def check_capture(db_path: Path, num_steps: int) -> int:
    """The number of events in a finished capture with one usage row per step."""
    conn = sqlite3.connect(db_path)
    try:
        ((status,),) = conn.execute("SELECT status FROM runs").fetchall()
        ((num_usage,),) = conn.execute("SELECT count(*) FROM usage").fetchall()
        ((num_events,),) = conn.execute("SELECT coalesce(sum(num_events), 0) FROM event_chunks").fetchall()
    finally:
        conn.close()
    if status != "finished" or num_usage != num_steps:
        raise AssertionError(
            f"{db_path}: run status {status!r} (want 'finished'), {num_usage} usage rows for {num_steps} steps"
        )
    return int(num_events)


# -- one case ------------------------------------------------------------------------------


class SplitFigure(NamedTuple):
    level: str
    timing: Timing
    seconds: dict[str, float]
    calls: dict[str, int]
    num_nested_calls: int

    @property
    def run_s(self) -> float:
        return self.timing.run_s


class CaseResult(NamedTuple):
    case: Case
    device_type: str
    outcome: Outcome  # the first timed run at off: the engine's figures
    malloc_runs: list[Timing]  # phase 1, glibc defaults, off
    rounds: list[dict[str, Timing]]
    splits: list[SplitFigure]
    num_events: int

    def median(self, key: str, part: str = "total_s") -> float:
        return statistics.median(getattr(r[key], part) for r in self.rounds)

    def overhead(self, key: str, part: str = "total_s") -> float:
        return self.median(key, part) / self.median("off", part) - 1

    def paired_overheads(self, key: str) -> list[float]:
        return [r[key].total_s / r["off"].total_s - 1 for r in self.rounds]


def load_trace(case: Case) -> list[TraceRequest]:
    return generate(case.workload, num_requests=case.num_requests, seed=0, vocab_size=MODEL.vocab_size, **case.options)


def run_malloc_phase(case: Case, device: torch.device) -> list[Timing]:
    trace = load_trace(case)
    run_once(case, trace, device, "off")
    return [run_once(case, trace, device, "off").timing for _ in range(MALLOC_RUNS)]


def run_case(
    case: Case, device: torch.device, num_repeats: int, malloc_runs: list[Timing], progress: Callable[[str], None]
) -> CaseResult:
    trace = load_trace(case)
    run_once(case, trace, device, "off")
    rounds: list[dict[str, Timing]] = []
    first: Outcome | None = None
    num_events: set[int] = set()
    for i in range(num_repeats):
        k = i % len(LEVELS)
        timings = {}
        for level in LEVELS[k:] + LEVELS[:k]:
            outcome = run_once(case, trace, device, level)
            timings[level] = outcome.timing
            first = first or (outcome if level == "off" else None)
            if level == "full":
                num_events.add(outcome.num_events)
        rounds.append(timings)
        progress(f"{device.type} {case.name} round {i + 1}/{num_repeats}")
    if len(num_events) != 1:
        raise AssertionError(f"{case.name}: full captures disagree on the number of events: {sorted(num_events)}")
    splits = [time_split(case, trace, device, level) for level in ("off", "full")]
    progress(f"{device.type} {case.name} split")
    assert first is not None
    return CaseResult(case, device.type, first, malloc_runs, rounds, splits, num_events.pop())


def time_split(case: Case, trace: list[TraceRequest], device: torch.device, level: str) -> SplitFigure:
    split = TimeSplit(synchronizer(device))
    outcome = run_once(case, trace, device, level, split)
    return SplitFigure(level, outcome.timing, split.seconds, split.calls, split.num_nested_calls[0])


# -- report --------------------------------------------------------------------------------


def fmt_rate(rate: float) -> str:
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.2f}{suffix}"
    return f"{rate:.1f}"


def pct(x: float) -> str:
    return f"{x:+.1%}"


def throughput_table(results: list[CaseResult]) -> str:
    lines = [
        "| device | case | requests | steps | prompt tokens | generated tokens | token hit rate | evicted tokens "
        "| run s (off) | requests/s | prompt tokens/s | generated tokens/s | requests/s (full, with close) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        s, run_s = r.outcome.stats, r.median("off", "run_s")
        lines.append(
            f"| {r.device_type} | {r.case.name} | {s.num_finished} | {r.outcome.num_steps} | {s.prompt_tokens:,} | "
            f"{s.generated_tokens:,} | {s.token_hit_rate:.1%} | {s.evicted_tokens:,} | {run_s:.2f} | "
            f"{fmt_rate(s.num_finished / run_s)} | {fmt_rate(s.prompt_tokens / run_s)} | "
            f"{fmt_rate(s.generated_tokens / run_s)} | {fmt_rate(s.num_finished / r.median('full'))} |"
        )
    return "\n".join(lines)


def malloc_table(results: list[CaseResult], kept: bool) -> str:
    after = "mallopt as above" if kept else "glibc defaults (--no-keep-freed-memory)"
    lines = [
        f"| device | case | run s, glibc defaults | page faults/run | run s, {after} | page faults/run | speed-up |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        before_s = statistics.median(t.run_s for t in r.malloc_runs)
        before_faults = statistics.median(t.num_page_faults for t in r.malloc_runs)
        after_s, after_faults = r.median("off", "run_s"), r.median("off", "num_page_faults")
        lines.append(
            f"| {r.device_type} | {r.case.name} | {before_s:.2f} | {before_faults:,.0f} | {after_s:.2f} | "
            f"{after_faults:,.0f} | {before_s / after_s:.2f}x |"
        )
    return "\n".join(lines)


def split_table(results: list[CaseResult], shim_costs: tuple[float, float]) -> str:
    lines = [
        "| device | case | level | run s (shimmed) | model | memory | recorder | rest "
        "| shimmed calls (model / memory / recorder) | shim cost (est.) |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        for f in r.splits:
            shares = " | ".join(f"{f.seconds[c] / f.run_s:.1%} ({f.seconds[c]:.3f} s)" for c in CATEGORIES)
            calls = " / ".join(f"{f.calls[c]:,}" for c in CATEGORIES[:3])
            shim_s = sum(f.calls.values()) * shim_costs[0] + f.num_nested_calls * shim_costs[1]
            lines.append(
                f"| {r.device_type} | {r.case.name} | {f.level} | {f.run_s:.2f} | {shares} | {calls} | "
                f"{shim_s / f.run_s:.1%} |"
            )
    return "\n".join(lines)


def overhead_table(results: list[CaseResult]) -> str:
    lines = [
        "| device | case | off s | summary s | full s | summary (wall / CPU) | full (wall / CPU) "
        "| full, range in a round | full, run only | CPU s (off → full) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        paired = r.paired_overheads("full")
        lines.append(
            f"| {r.device_type} | {r.case.name} | {r.median('off'):.3f} | {r.median('summary'):.3f} | "
            f"{r.median('full'):.3f} | {pct(r.overhead('summary'))} / {pct(r.overhead('summary', 'cpu_s'))} | "
            f"**{pct(r.overhead('full'))}** / {pct(r.overhead('full', 'cpu_s'))} | {pct(min(paired))} .. "
            f"{pct(max(paired))} | {pct(r.overhead('full', 'run_s'))} | {r.median('off', 'cpu_s'):.2f} → "
            f"{r.median('full', 'cpu_s'):.2f} |"
        )
    return "\n".join(lines)


def recording_parts(f: SplitFigure) -> dict[str, float]:
    """Seconds of recording work measured inside one full run (the shimmed one)."""
    return {
        "in recorder methods": f.seconds["recorder"],
        "writer process CPU": f.timing.writer_cpu_s,
        "close": f.timing.close_s,
    }


def same_run_overhead(f: SplitFigure) -> float:
    """Recording work / the rest of the same run, as if the writer's CPU were the engine's: an
    estimate that load changes between runs cannot skew (an upper bound: the writer has its own
    process and, with a core to spare, its own core)."""
    recording_s = sum(recording_parts(f).values())
    return recording_s / (f.timing.total_s - f.seconds["recorder"] - f.timing.close_s)


def where_table(results: list[CaseResult]) -> str:
    lines = [
        "| device | case | events | events/s | in recorder methods | writer process CPU | close "
        "| µs/event (sum) | same-run estimate | full - off, medians |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        f = r.splits[1]
        parts = recording_parts(f)
        cells = [f"{s * 1e3:.0f} ms" for s in parts.values()]
        lines.append(
            f"| {r.device_type} | {r.case.name} | {r.num_events:,} | "
            f"{fmt_rate(r.num_events / r.median('off', 'run_s'))} | {' | '.join(cells)} | "
            f"{sum(parts.values()) / max(r.num_events, 1) * 1e6:.1f} | {pct(same_run_overhead(f))} | "
            f"{(r.median('full') - r.median('off')) * 1e3:.0f} ms ({pct(r.overhead('full'))}) |"
        )
    return "\n".join(lines)


def target_verdict(wall_overhead: float, cpu_overhead: float) -> str:
    """Met or not met when wall time and CPU time agree; where only one is within, the noise decides."""
    within = (wall_overhead <= TARGET_OVERHEAD, cpu_overhead <= TARGET_OVERHEAD)
    if all(within) or not any(within):
        return "met" if all(within) else "not met"
    return "unclear (wall and CPU time disagree)"


def verdict_lines(results: list[CaseResult]) -> list[str]:
    lines = []
    for r in results:
        wall, cpu, off_split, full_split = r.overhead("full"), r.overhead("full", "cpu_s"), r.splits[0], r.splits[1]
        shares = {c: off_split.seconds[c] / off_split.run_s for c in CATEGORIES}
        parts = sorted(recording_parts(full_split).items(), key=lambda item: -item[1])
        largest = ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in parts[:2])
        lines.append(
            f"- {r.device_type} {r.case.name}: full vs off {pct(wall)} in wall time with close "
            f"({pct(r.overhead('full', 'run_s'))} without), {pct(cpu)} in CPU time, "
            f"{pct(same_run_overhead(full_split))} estimated within one run: "
            f"**≤ {TARGET_OVERHEAD:.0%} {target_verdict(wall, cpu)}**; largest: {largest}. At off the "
            f"model takes {shares['model']:.0%} of the run, memory management {shares['memory']:.0%}, "
            f"the rest {shares['rest']:.0%}."
        )
    return lines


ABOUT = (
    "The engine (tiny model) on three workloads: requests/s and tokens/s at recording off, and what "
    "recording at level full costs in wall and CPU time; CPU only until a GPU run adds its rows."
)


def figures(results: list[CaseResult]) -> list[Figure]:
    """RESULTS.md rows: per device and case, the throughput at off and the cost of recording."""
    rows = []
    for r in results:
        s, run_s = r.outcome.stats, r.median("off", "run_s")
        rows.append(
            Figure(
                f"{r.device_type} {r.case.name}: throughput at level off",
                f"{fmt_rate(s.num_finished / run_s)} requests/s, {fmt_rate(s.generated_tokens / run_s)} "
                f"generated tokens/s",
            )
        )
    for r in results:
        wall, cpu = r.overhead("full"), r.overhead("full", "cpu_s")
        rows.append(
            Figure(
                f"{r.device_type} {r.case.name}: recording full vs off, with close",
                f"{pct(wall)} wall, {pct(cpu)} CPU time; "
                f"{pct(same_run_overhead(r.splits[1]))} estimated within one run",
                f"≤ {TARGET_OVERHEAD:.0%} (wall and CPU)",
                target_verdict(wall, cpu).split(" (")[0],
            )
        )
    return rows


def context_lines(
    results: list[CaseResult],
    device_types: list[str],
    args: argparse.Namespace,
    kept: bool,
    total_s: float,
    load: tuple[float, float],
) -> list[str]:
    malloc = f"{MALLOPT_TEXT} after phase 1" if kept else "glibc defaults throughout"
    lines = [
        f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command_line()}`",
        f"- machine: {machine(' then '.join(device_types))}",
        f"- model `tiny` (float32), one torch thread (`torch.set_num_threads(1)`); {args.repeats} rounds per "
        f"case, {MALLOC_RUNS} runs in phase 1; malloc: {malloc}; load average (1 min) {load[0]:.2f} at the "
        f"start, {load[1]:.2f} at the end; whole run {total_s:.0f} s",
    ]
    if max(load) > BUSY_LOAD_AVERAGE:
        lines.append(
            f"- **the machine was busy**: load average above {BUSY_LOAD_AVERAGE} while this ran, so other "
            "processes took CPU from the runs and the figures compared across runs carry their noise; "
            "the within-run columns of `where it goes` are the steadier ones"
        )
    for r in results:
        pool = r.case.pool
        lines.append(
            f"- {r.device_type} {r.case.name}: {r.case.describe()}; KV {pool.kv_size_tokens:,} tokens, "
            f"{pool.max_running_requests} request rows; retractions {r.outcome.stats.num_retractions}"
        )
    return lines


READING = [
    "- `run` times `engine.run` (all requests submitted at once, until the last finishes); `close` times "
    "`recorder.close()` (the last hand-off, the writer process writing it and exiting, the run marked "
    "finished). Engine and recorder construction (which starts the writer process) and one warm-up run per "
    "case and phase are untimed. Tokens/s and requests/s divide the engine's totals by the median off run; "
    "the last column divides by the median full total.",
    "- Split: exclusive wall time on the engine's thread. `model` = `TinyTransformer.forward` (on CUDA "
    "followed by a synchronize, so the GPU's work lands there); `memory` = every public method of the "
    "MemorySystem, its allocator, radix cache and req_to_token pool, outermost call only; `recorder` = the "
    "recorder's record/usage/leak_check/request/tree_snapshot/flush plus the cache's `export_nodes` for the "
    "tree snapshots; `rest` = the scheduler's and the stats' Python around them (admission budget, batch "
    "building, the per-request argmax and output loop, validation). `shim cost` = the shimmed calls times "
    "the cost of one shim measured in isolation, as a share of the run: the shims' own time, spread over "
    "the categories.",
    "- Overhead = (median total of the level - median total at off) / median total at off; `range in a "
    "round` is the smallest and largest of the same ratio between runs of one round; `run only` leaves "
    "`close` out; `CPU` is the CPU time of the engine's process and of the recorder's writer process over "
    "run + close. The target's verdict is `met` when the wall-time and the CPU-time overhead are both "
    f"within {TARGET_OVERHEAD:.0%}, `not met` when both exceed it, and `unclear` otherwise.",
    "- Where it goes, measured inside one full run so that load changing between runs cannot skew it: "
    "`in recorder methods` = the caller's side, time in record() and the other recorder methods on the "
    "engine's thread (shims included), hand-offs to the writer (marshal and send) among them; `writer "
    "process CPU` = the recorder's writer process over run and close (`/proc/PID/schedstat` at the start, "
    "its rusage once it has exited): unmarshalling, packing, SQLite; `close` = the last hand-off and the "
    "wait for the writer to write it, exit, and the run row. `same-run estimate` = their sum / the rest of "
    "that run's total, as if the writer's work ran on the engine's core. Not in it: the producers' `if "
    "recorder.enabled:` work in the pools, cache and stats (one event's arguments, the per-request slot "
    "slices of a batch allocation).",
    "- This is a 2-core VM shared with other work: when another process holds a core (load average above "
    "~1.5, as the benchmark keeps about one busy itself), the writer process shares the engine's core and "
    "the wall-time figures swing between runs; the within-run columns vary much less.",
    f"- glibc malloc: medians of the {MALLOC_RUNS} phase-1 runs and of the rounds' off runs; `page faults` = "
    "the process's minor page faults during the run. Phase 1 runs before everything else, so on a busy "
    "machine `speed-up` also carries the change of load; the fault counts do not.",
]


def section_body(
    results: list[CaseResult], device_types: list[str], context: list[str], shim_costs: tuple[float, float], kept: bool
) -> str:
    parts = [
        *context,
        "",
        "### Throughput (median of the rounds at level off)",
        "",
        throughput_table(results),
        "",
        "### Where the wall time goes (one run per level with timing shims)",
        "",
        split_table(results, shim_costs),
        "",
        "### Cost of recording (median of alternating rounds; total = run + close)",
        "",
        overhead_table(results),
        "",
        "Where the extra time of `full` goes (measured inside the shimmed full run):",
        "",
        where_table(results),
        "",
        f"### Target: recording `full` costs ≤ {TARGET_OVERHEAD:.0%} over `off` (wall and CPU time)",
        "",
        *verdict_lines(results),
        "",
        "### glibc malloc and the model's temporaries (level off)",
        "",
        malloc_table(results, kept),
        "",
        "Reading the tables:",
        "",
        *READING,
    ]
    if "cuda" not in device_types:
        parts += [
            "",
            "CUDA figures are not recorded yet: no GPU was lent to the task that recorded this section. "
            "Rerun with `--device both` (the default where a GPU is present) on a GPU machine; there the "
            "decode-256 case decodes ~256 tokens per request (64 on CPU).",
        ]
    return "\n".join(parts)


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda", "both"],
        default="auto",
        help="auto: both where a GPU is present, else cpu",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"half the requests and outputs, {QUICK_REPEATS} rounds: about a minute on 2 cores",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"rounds of off/summary/full per case (default {DEFAULT_REPEATS})"
    )
    parser.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"after phase 1, {MALLOPT_TEXT} (glibc)",
    )
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="set its rows in the bench_engine table of benchmarks/RESULTS.md",
    )
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    if args.device == "auto":
        args.device = "both" if torch.cuda.is_available() else "cpu"
    if args.device in ("cuda", "both") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    device_types = ["cpu", "cuda"] if args.device == "both" else [args.device]
    planned = [(torch.device(d), case) for d in device_types for case in cases(d, args.quick)]
    start_s, load_start = time.perf_counter(), os.getloadavg()[0]

    def progress(what: str) -> None:
        print(f"  {what}: {time.perf_counter() - start_s:.1f} s", file=sys.stderr)

    malloc_runs = []
    for device, case in planned:
        malloc_runs.append(run_malloc_phase(case, device))
        progress(f"{device.type} {case.name} phase 1 (glibc defaults)")
    kept = args.keep_freed_memory and keep_freed_memory()
    results = [
        run_case(case, device, args.repeats, before, progress)
        for (device, case), before in zip(planned, malloc_runs, strict=True)
    ]
    shim_costs = shim_costs_s()
    context = context_lines(
        results, device_types, args, kept, time.perf_counter() - start_s, (load_start, os.getloadavg()[0])
    )
    body = section_body(results, device_types, context, shim_costs, kept)
    print(body)
    if args.write:
        load = f"load average {load_start:.2f} (1 min) at the start, {os.getloadavg()[0]:.2f} at the end"
        write_figures("bench_engine", ABOUT, figures(results), this_run(" then ".join(device_types), load))


if __name__ == "__main__":
    main()
