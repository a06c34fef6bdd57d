"""`kvscope run`: a workload or a trace through the engine into a capture, with progress
on stderr and a summary at the end."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvscope.engine.config import EngineConfig
from kvscope.engine.engine import Engine, check_faults, check_request
from kvscope.engine.faults import FaultSpec
from kvscope.engine.model import ModelConfig
from kvscope.engine.request import Req
from kvscope.engine.stats import EngineStats
from kvscope.telemetry import NULL_RECORDER, Recorder
from kvscope.telemetry.fingerprint import environment_fingerprint
from kvscope.workloads import TraceRequest, generate, read_trace


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


class Progress:
    """One line on stderr, redrawn at most ten times a second (only on a terminal)."""

    def __init__(self, total: int, out: TextIO = sys.stderr) -> None:
        self.total = total
        self.out = out
        self.live = out.isatty()
        self.last = 0.0

    def __call__(self, stats: EngineStats, submitted: int) -> None:
        now = time.monotonic()
        if not self.live or now - self.last < 0.1:
            return
        self.last = now
        done = stats.num_finished + stats.num_aborted
        width = 30
        filled = width * done // max(self.total, 1)
        self.out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} done, "
                       f"{submitted} arrived, hit {stats.token_hit_rate:.0%}, retracted {stats.num_retractions}  ")
        self.out.flush()

    def close(self) -> None:
        if self.live:
            self.out.write("\n")


def open_recorder(spec: RunSpec, device: str) -> tuple[Recorder, Path | None]:
    if spec.level == "off":
        return NULL_RECORDER, None
    from kvscope.telemetry.recorder import SQLRecorder

    path = spec.capture or default_capture_path(spec.label)
    return SQLRecorder(path, level=spec.level, label=spec.label, config=fingerprint(spec, device)), path


def run(spec: RunSpec, out: TextIO = sys.stdout) -> EngineStats:
    trace = load_requests(spec)
    if not trace:
        raise ValueError("the workload has no requests")
    requests = to_engine_requests(trace)
    spec.engine.check_model(spec.model.sliding_window, spec.model.is_hybrid)  # before any capture is created
    check_faults(spec.engine, spec.model, list(spec.faults))
    for req in requests:
        check_request(spec.engine, spec.model, req)
    recorder, path = open_recorder(spec, spec.engine.device)
    start = time.monotonic()
    progress = Progress(len(requests))
    status, error = "finished", None
    try:
        engine = Engine(spec.engine, spec.model, recorder, debug=spec.debug, faults=list(spec.faults),
                        fault_seed=spec.fault_seed)
        stats = engine.run(requests, pace_per_s=spec.pace_per_s, progress=progress)
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
    if path is not None and spec.level == "full" and spec.store_report:
        verdict = store_leak_report(path, getattr(recorder, "run_id", None))
    print_summary(stats, wall_s, path, out, verdict)
    return stats


def store_leak_report(path: Path, run_id: int | None, err: TextIO = sys.stderr) -> str:
    """Build the debugger's leak report of the run just closed and store it in the capture, so
    the dashboard and `report leaks` need not replay the events again. Returns the verdict line."""
    from kvscope.debug.report import ReplayProgress, build_report, check_reason, save_report
    from kvscope.telemetry.store import CaptureError

    progress = ReplayProgress(err)
    try:
        report = build_report(path, run_id, on_progress=progress)
        save_report(path, report)
    except (CaptureError, ValueError) as exc:
        return f"not stored ({exc})"
    finally:
        progress.close()
    return f"{check_reason(report)} (stored in the capture)"


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
