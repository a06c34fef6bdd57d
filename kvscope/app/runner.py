"""`kvscope run`: a workload or a trace through the engine into a capture, with progress on
stderr, the leak report stored in the capture when the run closes, and a summary at the end.

This is where the run is wired: the SQL recorder (the capture), the debugger's monitor as
recorder and read checker when `--debug` is on, and the engine that knows neither.

NOTE: how a run ends, in its capture and in `kvscope run`'s exit code
    finished     ran to its end                                      0, or 1 if an idle leak check failed
    interrupted  Ctrl-C, SIGTERM or SIGHUP (kvscope.__main__ turns   130, 143, 129
                 them into KeyboardInterrupt); requests still admitted or waiting get in_flight rows
    crashed      an exception; runs.error holds its line; in_flight rows too    (the exception propagates)
    incomplete   the recorder stopped (a failed write, its writer process died   4 (RecordingStopped)
                 or stalled: its `failure` line); the run stops at its next step, as nothing more
                 could be recorded, and the summary says it was cut short
Closing happens with these signals held, so a second Ctrl-C cannot leave the run 'running'; a
writer that stalls cannot hold the close up for more than a few seconds either (recorder.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from kvscope.app.checkpointer import start_checkpointer, stop_checkpointer
from kvscope.app.progress import Progress, bar
from kvscope.app.report import store_leak_report
from kvscope.app.units import scoped_cache_options
from kvscope.debug import DebugMonitor
from kvscope.engine import (
    AUTO,
    CacheConfig,
    CacheKind,
    Engine,
    EngineConfig,
    EngineStalled,
    EngineStats,
    FaultSpec,
    LeakDetected,
    ModelConfig,
    PoolConfig,
    ProgressHook,
    Req,
    SchedulerConfig,
    auto_cache_kind,
    cache_kind,
    check_faults,
    check_request,
    either,
    kinds_with,
    model_config,
)
from kvscope.engine.model import kv_pool_shape
from kvscope.mem import resolve_device
from kvscope.telemetry import (
    NULL_RECORDER,
    FaultKind,
    Recorder,
    Retention,
    RunStatus,
    SQLRecorder,
    display_name,
    environment_fingerprint,
)
from kvscope.workloads import TraceRequest, generate, read_trace

PROGRESS_INTERVAL_S = 0.1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # as kvscope.__main__'s
EXIT_RECORDING_STOPPED = 4


class RecordingStopped(RuntimeError):
    """The capture stopped recording on a write failure; the message says through which step
    it is complete. The run stops at its next step (its summary is printed)."""


@dataclass(frozen=True)
class RunSpec:
    engine: EngineConfig
    model: ModelConfig
    workload: str | None = None
    trace: Path | None = None
    num_requests: int = 64
    seed: int = 0
    level: str = "full"
    capture: str | Path | None = None  # a file path or a SQLAlchemy URL, verbatim (Path() folds sqlite:////x's slashes)
    pace_per_s: float | None = None
    workload_options: dict[str, Any] = field(default_factory=dict)
    debug: bool = False
    faults: tuple[FaultSpec, ...] = ()
    fault_seed: int = 0
    store_report: bool = True  # level full: build the leak report at close and store it in the capture
    retention: Retention | None = None  # what the run keeps of its events (None: all)

    @property
    def label(self) -> str:
        return self.workload or (self.trace.stem if self.trace else "run")


def engine_from_args(
    args: argparse.Namespace, leak_check_raise: bool = False, serving: bool = False
) -> tuple[EngineConfig, ModelConfig]:
    """The engine and model of the engine options `run` and `serve` share (commands/engine_options.py);
    ValueError on an impossible config. `serving`: --torch-threads auto leaves a core to the
    HTTP front when the engine runs on the CPU (torch's default takes them all, and its threads
    then fight the front and its clients for the cores: half the throughput on two cores)."""
    model = model_config(args.model)
    cache: CacheKind = args.cache if args.cache != AUTO else auto_cache_kind(model.is_hybrid)
    engine = EngineConfig(
        pool=PoolConfig(
            kv_size_tokens=args.kv_tokens,
            page_size=args.page_size,
            swa_full_tokens_ratio=args.swa_ratio,
            max_running_requests=args.max_running_requests,
            max_context_len=args.max_context_len,
        ),
        cache=CacheConfig(
            kind=cache,
            eviction_policy=args.eviction_policy,
            eviction_granularity=args.eviction_granularity,
            **scoped_cache_options(args, cache),
            **host_cache_options(args, cache),
        ),
        scheduler=SchedulerConfig(
            chunked_prefill_size=args.chunked_prefill_size or None,
            leak_check_raise=leak_check_raise,
            schedule_policy=args.schedule_policy,
        ),
        device=args.device,
        strict=args.strict,
        torch_threads=args.torch_threads,
    )
    if serving and engine.torch_threads is None and resolve_device(engine.device).type == "cpu":
        engine = replace(engine, torch_threads=max(1, len(os.sched_getaffinity(0)) - 1))
    return engine, model


HOST_OPTIONS = {"write_policy": "--write-policy", "host_ratio": "--host-ratio", "host_tokens": "--host-tokens"}


def host_cache_options(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The hiradix cache's settings given in `args` (cli.add_host_options); ValueError naming
    the flags when any is given for another cache kind."""
    given = {name: getattr(args, name) for name in HOST_OPTIONS if getattr(args, name, None) is not None}
    if given and not cache_kind(kind).has_host:
        flags = ", ".join(HOST_OPTIONS[name] for name in given)
        raise ValueError(
            f"{flags} {'applies' if len(given) == 1 else 'apply'} to --cache "
            f"{either(kinds_with(lambda spec: spec.has_host))} only, not {kind}"
        )
    return given


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The RunSpec of `kvscope run`'s arguments (see commands/run.py); ValueError on an impossible config."""
    engine, model = engine_from_args(args, leak_check_raise=args.leak_check == "raise")
    faults = [FaultSpec.parse(text) for text in args.inject]
    debug = args.debug or any(f.kind == FaultKind.USE_AFTER_FREE for f in faults)
    return RunSpec(
        engine=engine,
        model=model,
        workload=args.workload,
        trace=Path(args.trace) if args.trace else None,
        num_requests=args.num_requests,
        seed=args.seed,
        level=args.level,
        capture=args.capture,
        pace_per_s=args.pace,
        debug=debug,
        faults=tuple(faults),
        fault_seed=args.inject_seed,
        store_report=not args.no_report,
        retention=retention_from_args(args),
    )


def retention_from_args(args: argparse.Namespace) -> Retention | None:
    """The retention options (commands/retention_options.py); gated on the ledger at level full, whose
    verdict replays every event (telemetry/retention.py)."""
    retention = Retention(getattr(args, "keep_events", None), getattr(args, "max_size", None), args.level == "full")
    return retention if retention.bounded else None


def run_verb(args: argparse.Namespace) -> int:
    """Exit code 1 when an idle leak check failed (or stopped the run, with --leak-check raise),
    4 when the capture stopped recording; an interrupt is cli.main's (130, 143, 129)."""
    spec = spec_from_args(args)
    try:
        stats = run(spec)
    except (LeakDetected, EngineStalled) as err:
        print(f"kvscope {args.verb}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    except RecordingStopped:  # the recorder printed its one line when it stopped
        return EXIT_RECORDING_STOPPED
    return 1 if stats.leak_checks_failed else 0


def default_capture_path(label: str) -> str:
    return f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{label}.db"


def load_requests(spec: RunSpec) -> list[TraceRequest]:
    vocab = spec.model.vocab_size
    if spec.trace is not None:
        return read_trace(spec.trace, vocab_size=vocab, max_seq_len=spec.engine.pool.max_context_len)
    assert spec.workload is not None
    return generate(
        spec.workload, num_requests=spec.num_requests, seed=spec.seed, vocab_size=vocab, **spec.workload_options
    )


def to_engine_requests(trace: list[TraceRequest]) -> list[Req]:
    return [Req(t.rid, t.prompt_ids, t.output_len, user=t.user, forced_output_ids=t.output_ids) for t in trace]


def fingerprint(spec: RunSpec, device: str) -> dict[str, Any]:
    return {
        "engine": spec.engine.fingerprint(),
        "model": asdict(spec.model),
        "kv": kv_fingerprint(spec.model),
        "workload": {
            "name": spec.workload,
            "trace": str(spec.trace) if spec.trace else None,
            "num_requests": spec.num_requests,
            "seed": spec.seed,
            "options": spec.workload_options,
            "pace_per_s": spec.pace_per_s,
        },
        "debug": {
            "enabled": spec.debug,
            "faults": [f"{f.kind}:{f.rate}" for f in spec.faults],
            "fault_seed": spec.fault_seed,
        },
        "environment": environment_fingerprint(device),
    }


def kv_fingerprint(model: ModelConfig) -> dict[str, Any]:
    """The KV sizes a reader of the capture needs (the dashboard's bytes per token moved)."""
    return {"full_bytes_per_token": kv_pool_shape(model).full_bytes_per_token}


def capture_path(spec: RunSpec) -> str | Path | None:
    """Where the run's capture goes, as given; None at level off."""
    if spec.level == "off":
        return None
    return spec.capture or default_capture_path(spec.label)


def engine_progress(progress: Progress, num_requests: int) -> ProgressHook:
    """The engine's progress hook: requests done and arrived, hit rate, retractions."""

    def on_step(stats: EngineStats, num_submitted: int) -> None:
        if progress.due():
            done = stats.num_finished + stats.num_aborted
            progress.draw(
                f"{bar(done, num_requests)} {done}/{num_requests} done, {num_submitted} arrived, "
                f"hit {stats.token_hit_rate:.0%}, retracted {stats.num_retractions}  "
            )

    return on_step


def run(spec: RunSpec, out: TextIO | None = None) -> EngineStats:
    """Run the spec's requests into its capture and print the summary on `out`. A request or a
    config that cannot run raises ValueError before any capture is created; a capture that
    stopped recording raises RecordingStopped once the summary is printed."""
    out = sys.stdout if out is None else out
    requests = checked_requests(spec)
    path = capture_path(spec)
    start = time.monotonic()
    try:
        capture, stats = record_run(spec, path, requests)
    except (KeyboardInterrupt, SystemExit) as stop:
        partial = getattr(stop, "stats", None)  # NOTE: record_run's, with the run closed 'interrupted'
        if partial is not None:
            with signals_held():  # NOTE: a second Ctrl-C must not cut the summary of the first short
                print_summary(partial, time.monotonic() - start, path, out, stopped=getattr(stop, "line", None))
        raise
    wall_s = time.monotonic() - start
    failure = getattr(capture, "failure", None)
    verdict = None
    if path is not None and capture is not None and spec.level == "full" and spec.store_report and not failure:
        verdict = store_leak_report(path, capture.run_id)
    print_summary(stats, wall_s, path, out, verdict, failure)
    if failure:
        raise RecordingStopped(failure)
    return stats


def checked_requests(spec: RunSpec) -> list[Req]:
    """The spec's requests, each checked against its config (ValueError for one that can never run)."""
    trace = load_requests(spec)
    if not trace:
        raise ValueError("the workload has no requests")
    requests = to_engine_requests(trace)
    # NOTE: before any capture is created: the model fits the cache, and the pools the memory
    spec.engine.check_model(spec.model.sliding_window, spec.model.is_hybrid, spec.model)
    check_faults(spec.engine, spec.model, list(spec.faults))
    for req in requests:
        check_request(spec.engine, spec.model, req)
    return requests


def record_run(spec: RunSpec, path: str | Path | None, requests: list[Req]) -> tuple[SQLRecorder | None, EngineStats]:
    """The engine's run into a new capture at `path` (none when None), closed whatever happens:
    finished, interrupted (KeyboardInterrupt, SystemExit) or crashed (any other exception, which
    propagates), with the requests still in flight stored as such."""
    capture: SQLRecorder | None = None
    recorder: Recorder = NULL_RECORDER
    progress = Progress(interval_s=PROGRESS_INTERVAL_S)
    engine: Engine | None = None
    checkpointer = None
    status, error = RunStatus.FINISHED, None
    try:
        if path is not None:
            with signals_held():  # a capture is never left half made: a Ctrl-C here comes once it exists
                capture = recorder = SQLRecorder(
                    path,
                    level=spec.level,
                    label=spec.label,
                    config=fingerprint(spec, spec.engine.device),
                    retention=spec.retention,
                )
                checkpointer = start_checkpointer(path, spec.retention, capture.run_id)
        monitor = DebugMonitor(recorder) if spec.debug else None
        engine = Engine(
            spec.engine,
            spec.model,
            recorder if monitor is None else monitor,
            read_checker=monitor,
            faults=list(spec.faults),
            fault_seed=spec.fault_seed,
        )
        hook = stop_when_recording_stops(engine_progress(progress, len(requests)), capture)
        stats = engine.run(requests, pace_per_s=spec.pace_per_s, progress=hook)
    except RecordingStopped:  # nothing more can be recorded: the run ends here, its capture incomplete
        assert engine is not None
        status, stats = RunStatus.INCOMPLETE, engine.stats
    except (KeyboardInterrupt, SystemExit) as stop:
        status, error = RunStatus.INTERRUPTED, stop_line(stop, engine)
        if engine is not None:  # NOTE: for run()'s partial summary (the signal's number rides on it too)
            stop.stats, stop.line = engine.stats, error  # type: ignore[union-attr]
        raise
    except BaseException as err:
        status, error = RunStatus.CRASHED, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        raise
    finally:
        with signals_held():
            progress.close()
            if engine is not None and status != RunStatus.FINISHED:
                engine.stats.close_in_flight()
            stop_checkpointer(checkpointer)
            recorder.close(status, error)
    return capture, stats


def stop_when_recording_stops(hook: ProgressHook, capture: SQLRecorder | None) -> ProgressHook:
    """`hook`, after a check that the capture still records (a run that cannot be recorded stops)."""

    def on_step(stats: EngineStats, num_submitted: int) -> None:
        if capture is not None and capture.failure:
            raise RecordingStopped(capture.failure)
        hook(stats, num_submitted)

    return on_step


def stop_line(stop: BaseException, engine: Engine | None) -> str:
    """runs.error of an interrupted run: `SIGTERM at step 31`."""
    signum = getattr(stop, "signum", signal.SIGINT if isinstance(stop, KeyboardInterrupt) else None)
    if signum is None and isinstance(stop, SystemExit) and isinstance(stop.code, int) and stop.code > 128:
        signum = stop.code - 128  # an exit raised by a signal handler (128 + signum)
    try:
        cause = signal.Signals(signum).name if signum is not None else type(stop).__name__
    except ValueError:
        cause = type(stop).__name__
    return cause if engine is None else f"{cause} at step {engine.scheduler.step}"


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP inside; afterwards deliver the first one that came (to
    whatever handler was there before: an ignored one stays ignored). Main thread only: other
    threads never run Python signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        if held:
            signal.raise_signal(held[0])


def host_tier_line(stats: EngineStats) -> str:
    host = stats.host_tier
    assert host is not None
    share = f" ({stats.host_hit_tokens / stats.cached_tokens:.1%} of cached tokens)" if stats.cached_tokens else ""
    return (
        f"host tier         {host.host_tokens} tokens: {host.written} written, {host.loaded} loaded back, "
        f"{stats.host_hit_tokens} cached tokens came from the host{share}, {host.dropped} dropped"
    )


def print_summary(
    stats: EngineStats,
    wall_s: float,
    capture: str | Path | None,
    out: TextIO,
    leak_report: str | None = None,
    failure: str | None = None,
    stopped: str | None = None,
) -> None:
    """The run's summary; `failure`: why recording stopped; `stopped`: why the run was interrupted
    (its figures are then those so far, and the capture holds the run closed 'interrupted')."""
    checks = stats.leak_checks_passed + stats.leak_checks_failed
    verdict = (
        f"{stats.leak_checks_failed} FAILED"
        if stats.leak_checks_failed
        else "all passed"
        if checks
        else "none ran: no idle point"
    )
    where = f" (incomplete: {failure})" if failure else f" (interrupted: {stopped})" if stopped else ""
    cut = (
        " (cut short: the run stopped when recording stopped)"
        if failure
        else f" (cut short: {stopped}; the rest never ran)"
        if stopped
        else ""
    )
    lines = [
        f"requests          {stats.num_finished} finished, {stats.num_aborted} aborted of {stats.num_requests}{cut}",
        f"prompt tokens     {stats.prompt_tokens}",
        f"cached tokens     {stats.cached_tokens}",
        f"generated tokens  {stats.generated_tokens}",
        f"hit rate          {stats.token_hit_rate:.1%} token-weighted, {stats.request_hit_rate:.1%} request-weighted",
        f"evicted tokens    {stats.evicted_tokens}",
        f"retractions       {stats.num_retractions}",
        *([host_tier_line(stats)] if stats.host_tier is not None else []),
        f"leak checks       {checks} ({verdict})",
        *([f"leak report       {leak_report}"] if leak_report else []),
        f"wall time         {wall_s:.2f} s",
        f"capture           {display_name(capture) if capture else '(recording off)'}{where}",
    ]
    out.write("\n".join(lines) + "\n")
