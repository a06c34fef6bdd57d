"""`kvscope run`: a workload or a trace through the engine into a capture, with progress on
stderr, the leak report stored in the capture when the run closes, and a summary at the end.

This is where the run is wired: the SQL recorder (the capture), the debugger's monitor as
recorder and read checker when `--debug` is on, and the engine that knows neither.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvscope.app.progress import Progress, bar
from kvscope.app.report import store_leak_report
from kvscope.debug import DebugMonitor
from kvscope.engine import (
    CacheConfig,
    CacheKind,
    Engine,
    EngineConfig,
    EngineStats,
    FaultSpec,
    LeakDetected,
    ModelConfig,
    PoolConfig,
    ProgressHook,
    Req,
    SchedulerConfig,
    check_faults,
    check_request,
    model_config,
)
from kvscope.telemetry import (
    NULL_RECORDER,
    FaultKind,
    Recorder,
    SQLRecorder,
    environment_fingerprint,
    install_signal_handlers,
)
from kvscope.workloads import TraceRequest, generate, read_trace

PROGRESS_INTERVAL_S = 0.1


@dataclass(frozen=True)
class RunSpec:
    engine: EngineConfig
    model: ModelConfig
    workload: str | None = None
    trace: Path | None = None
    num_requests: int = 64
    seed: int = 0
    level: str = "full"
    capture: Path | None = None
    pace_per_s: float | None = None
    workload_options: dict[str, Any] = field(default_factory=dict)
    debug: bool = False
    faults: tuple[FaultSpec, ...] = ()
    fault_seed: int = 0
    store_report: bool = True  # level full: build the leak report at close and store it in the capture

    @property
    def label(self) -> str:
        return self.workload or (self.trace.stem if self.trace else "run")


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The RunSpec of `kvscope run`'s arguments (see cli.py); ValueError on an impossible config."""
    model = model_config(args.model)
    cache: CacheKind = args.cache if args.cache != "auto" else ("swa-radix" if model.is_hybrid else "radix")
    engine = EngineConfig(
        pool=PoolConfig(kv_size_tokens=args.kv_tokens, page_size=args.page_size, swa_full_tokens_ratio=args.swa_ratio,
                        max_running_requests=args.max_running_requests, max_context_len=args.max_context_len),
        cache=CacheConfig(kind=cache, eviction_policy=args.eviction_policy,
                          eviction_granularity=args.eviction_granularity),
        scheduler=SchedulerConfig(chunked_prefill_size=args.chunked_prefill_size or None,
                                  leak_check_raise=args.leak_check == "raise"),
        device=args.device, strict=args.strict,
    )
    faults = [FaultSpec.parse(text) for text in args.inject]
    debug = args.debug or any(f.kind == FaultKind.USE_AFTER_FREE for f in faults)
    return RunSpec(engine=engine, model=model, workload=args.workload, trace=Path(args.trace) if args.trace else None,
                   num_requests=args.num_requests, seed=args.seed, level=args.level,
                   capture=Path(args.capture) if args.capture else None, pace_per_s=args.pace, debug=debug,
                   faults=tuple(faults), fault_seed=args.inject_seed, store_report=not args.no_report)


def run_verb(args: argparse.Namespace) -> int:
    """Exit code 1 when an idle leak check failed (or stopped the run, with --leak-check raise)."""
    spec = spec_from_args(args)
    install_signal_handlers()
    try:
        stats = run(spec)
    except LeakDetected as err:
        print(f"kvscope {args.verb}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    return 1 if stats.leak_checks_failed else 0


def default_capture_path(label: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}.db"


def load_requests(spec: RunSpec) -> list[TraceRequest]:
    vocab = spec.model.vocab_size
    if spec.trace is not None:
        return read_trace(spec.trace, vocab_size=vocab)
    assert spec.workload is not None
    return generate(spec.workload, num_requests=spec.num_requests, seed=spec.seed, vocab_size=vocab,
                    **spec.workload_options)


def to_engine_requests(trace: list[TraceRequest]) -> list[Req]:
    return [Req(t.rid, t.prompt_ids, t.output_len, user=t.user, forced_output_ids=t.output_ids) for t in trace]


def fingerprint(spec: RunSpec, device: str) -> dict[str, Any]:
    return {
        "engine": spec.engine.fingerprint(),
        "model": asdict(spec.model),
        "workload": {"name": spec.workload, "trace": str(spec.trace) if spec.trace else None,
                     "num_requests": spec.num_requests, "seed": spec.seed, "options": spec.workload_options,
                     "pace_per_s": spec.pace_per_s},
        "debug": {"enabled": spec.debug, "faults": [f"{f.kind}:{f.rate}" for f in spec.faults],
                  "fault_seed": spec.fault_seed},
        "environment": environment_fingerprint(device),
    }


def capture_path(spec: RunSpec) -> Path | None:
    """Where the run's capture goes; None at level off."""
    if spec.level == "off":
        return None
    return spec.capture or default_capture_path(spec.label)


def engine_progress(progress: Progress, num_requests: int) -> ProgressHook:
    """The engine's progress hook: requests done and arrived, hit rate, retractions."""

    def on_step(stats: EngineStats, num_submitted: int) -> None:
        if progress.due():
            done = stats.num_finished + stats.num_aborted
            progress.draw(f"{bar(done, num_requests)} {done}/{num_requests} done, {num_submitted} arrived, "
                          f"hit {stats.token_hit_rate:.0%}, retracted {stats.num_retractions}  ")

    return on_step


def run(spec: RunSpec, out: TextIO = sys.stdout) -> EngineStats:
    """Run the spec's requests into its capture and print the summary on `out`. A request or a
    config that cannot run raises ValueError before any capture is created."""
    trace = load_requests(spec)
    if not trace:
        raise ValueError("the workload has no requests")
    requests = to_engine_requests(trace)
    spec.engine.check_model(spec.model.sliding_window, spec.model.is_hybrid)  # before any capture is created
    check_faults(spec.engine, spec.model, list(spec.faults))
    for req in requests:
        check_request(spec.engine, spec.model, req)
    path = capture_path(spec)
    capture = None if path is None else SQLRecorder(path, level=spec.level, label=spec.label,
                                                    config=fingerprint(spec, spec.engine.device))
    recorder: Recorder = NULL_RECORDER if capture is None else capture
    start = time.monotonic()
    progress = Progress(interval_s=PROGRESS_INTERVAL_S)
    status, error = "finished", None
    try:
        monitor = DebugMonitor(recorder) if spec.debug else None
        engine = Engine(spec.engine, spec.model, recorder if monitor is None else monitor, read_checker=monitor,
                        faults=list(spec.faults), fault_seed=spec.fault_seed)
        stats = engine.run(requests, pace_per_s=spec.pace_per_s, progress=engine_progress(progress, len(requests)))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        status, error = "crashed", f"{type(err).__name__}: {err}"
        raise
    finally:
        progress.close()
        recorder.close(status, error)
    wall_s = time.monotonic() - start
    verdict = None
    if path is not None and capture is not None and spec.level == "full" and spec.store_report:
        verdict = store_leak_report(path, capture.run_id)
    print_summary(stats, wall_s, path, out, verdict)
    return stats


def print_summary(stats: EngineStats, wall_s: float, capture: Path | None, out: TextIO,
                  leak_report: str | None = None) -> None:
    checks = stats.leak_checks_passed + stats.leak_checks_failed
    verdict = "all passed" if not stats.leak_checks_failed else f"{stats.leak_checks_failed} FAILED"
    lines = [
        f"requests          {stats.num_finished} finished, {stats.num_aborted} aborted of {stats.num_requests}",
        f"prompt tokens     {stats.prompt_tokens}",
        f"cached tokens     {stats.cached_tokens}",
        f"generated tokens  {stats.generated_tokens}",
        f"hit rate          {stats.token_hit_rate:.1%} token-weighted, {stats.request_hit_rate:.1%} request-weighted",
        f"evicted tokens    {stats.evicted_tokens}",
        f"retractions       {stats.num_retractions}",
        f"leak checks       {checks} ({verdict})",
        *([f"leak report       {leak_report}"] if leak_report else []),
        f"wall time         {wall_s:.2f} s",
        f"capture           {capture if capture else '(recording off)'}",
    ]
    out.write("\n".join(lines) + "\n")
