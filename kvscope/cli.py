"""The `kvscope` command. Each verb parses its arguments here and calls into the packages."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from kvscope.mem.demo import run_demo

    run_demo(args.device, args.page_size, args.delay)
    return 0


def _runs(args: argparse.Namespace) -> int:
    from kvscope.telemetry.queries import Capture

    capture = Capture(args.capture)
    frame = capture.runs()
    capture.close()
    if frame.empty:
        print(f"{args.capture}: no runs recorded")
        return 0
    print(f"{'id':>4}  {'status':<22} {'level':<8} {'started (UTC)':<20} {'seconds':>8}  label")
    for row in frame.itertuples():
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row.started_at))
        end = row.ended_at if row.ended_at == row.ended_at and row.ended_at is not None else row.heartbeat_at
        print(f"{row.id:>4}  {row.display_status:<22} {row.level:<8} {started:<20} {end - row.started_at:>8.1f}  "
              f"{row.label}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from kvscope.engine.faults import FaultSpec
    from kvscope.engine.model import model_config
    from kvscope.engine.runner import RunSpec, run
    from kvscope.telemetry import FaultKind
    from kvscope.telemetry.recorder import install_signal_handlers

    model = model_config(args.model)
    cache = args.cache if args.cache != "auto" else ("swa-radix" if model.is_hybrid else "radix")
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
    spec = RunSpec(engine=engine, model=model, workload=args.workload, trace=Path(args.trace) if args.trace else None,
                   num_requests=args.num_requests, seed=args.seed, level=args.level,
                   capture=Path(args.capture) if args.capture else None, pace_per_s=args.pace, debug=debug,
                   faults=tuple(faults), fault_seed=args.inject_seed, store_report=not args.no_report)
    install_signal_handlers()
    stats = run(spec)
    return 1 if stats.leak_checks_failed else 0


def _build_report(args: argparse.Namespace) -> Any:
    """Always replayed afresh (the stored copy is the dashboard's shortcut), with progress."""
    from kvscope.debug.report import ReplayProgress, build_report

    progress = ReplayProgress()
    try:
        return build_report(args.capture, args.run, on_progress=progress)
    finally:
        progress.close()


def _report(args: argparse.Namespace) -> int:
    from kvscope.debug.report import render_text

    report = _build_report(args)
    print(report.to_json() if args.json else render_text(report))
    return 0


def _check(args: argparse.Namespace) -> int:
    from kvscope.debug.report import check_reason

    report = _build_report(args)
    print(f"{args.capture}: {check_reason(report)}")
    return 0 if report.clean else 1


def _diff(args: argparse.Namespace) -> int:
    from kvscope.debug.diff import render_diff

    print(render_diff(args.a, args.b))
    return 0


def _add_debugger(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fmt = argparse.ArgumentDefaultsHelpFormatter
    report = verbs.add_parser("report", help="explain a capture (report leaks CAPTURE)", formatter_class=fmt,
                              description="Reports over a capture.")
    topics = report.add_subparsers(dest="topic", required=True, metavar="TOPIC")
    leaks = topics.add_parser(
        "leaks", formatter_class=fmt, help="name the culprits of every leak",
        description="For each leak: the pool, the slots, the request that last owned them and its principal, the "
        "step and event that allocated them, the free that never came, the first failing leak check and the onset "
        "step. A capture recorded below level full has no slot indices: the report says so and works from the "
        "leak checks and the requests table.")
    leaks.add_argument("capture", help="a capture file or a SQLAlchemy URL")
    leaks.add_argument("--run", type=int, help="run id (default: the latest run)")
    leaks.add_argument("--json", action="store_true", help="machine-readable output")
    leaks.set_defaults(func=_report)
    check = verbs.add_parser(
        "check", formatter_class=fmt, help="CI gate: exit 0 clean, 1 on a leak or broken invariant, 2 unreadable",
        description="Exit 0 when the capture is clean, 1 on a leak or a broken invariant (with the one-line "
        "reason), 2 when the capture cannot be read.")
    check.add_argument("capture", help="a capture file or a SQLAlchemy URL")
    check.add_argument("--run", type=int, help="run id (default: the latest run)")
    check.set_defaults(func=_check)
    diff = verbs.add_parser("diff", formatter_class=fmt, help="two captures side by side",
                            description="Usage peaks, hit rates, evictions, retractions, the last leak-check terms "
                            "and event counts per kind of the latest run of each capture.")
    diff.add_argument("a", help="first capture")
    diff.add_argument("b", help="second capture")
    diff.set_defaults(func=_diff)


def _add_run(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvscope.engine.config import CACHE_KINDS
    from kvscope.workloads import WORKLOADS

    run = verbs.add_parser(
        "run",
        help="run a workload or a trace through the engine and record a capture",
        description="Run requests through the instrumented engine (a tiny seeded transformer on real KV pools) "
        "and record every memory event into a capture. Exit code 1 when an idle leak check failed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload")
    source.add_argument("--trace", metavar="FILE", help="a JSONL trace: one {id, user, prompt, output} per line")
    run.add_argument("--num-requests", type=int, default=64, help="requests to generate (with --workload)")
    run.add_argument("--seed", type=int, default=0, help="workload seed")
    run.add_argument("--model", default="tiny", help="tiny, tiny-swa, or a shape like 'layers=4,hidden=64,window=32'")
    run.add_argument("--cache", default="auto", choices=["auto", *CACHE_KINDS],
                     help="prefix cache; auto = radix, or swa-radix for a sliding-window model")
    run.add_argument("--eviction-policy", default="lru", help="lru, lfu, fifo, mru, filo, priority, slru")
    run.add_argument("--eviction-granularity", default="leaf", choices=["leaf", "page"],
                     help="leaf: SGLang's whole-leaf eviction; page: only the pages needed")
    run.add_argument("--page-size", type=int, default=1, help="tokens per KV page (a power of two)")
    run.add_argument("--kv-tokens", type=int, default=4096, help="KV capacity of the full pool, in tokens")
    run.add_argument("--swa-ratio", type=float, default=0.8, help="SWA pool size as a fraction of the full pool")
    run.add_argument("--chunked-prefill-size", type=int, default=256, help="tokens per prefill chunk; 0 disables")
    run.add_argument("--max-running-requests", type=int, default=32, help="request rows in req_to_token")
    run.add_argument("--max-context-len", type=int, default=2048, help="longest prompt + output, in tokens")
    run.add_argument("--level", default="full", choices=["off", "summary", "full"],
                     help="summary: usage, requests, leak checks, tree snapshots; full: plus every memory event")
    run.add_argument("--capture", metavar="PATH", help="capture file (default runs/<time>-<workload>.db)")
    run.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
    run.add_argument("--pace", type=float, metavar="RATE",
                     help="arrivals per second in real time; without it all requests arrive at once")
    run.add_argument("--strict", action="store_true", help="pools and caches check every call for misuse")
    run.add_argument("--leak-check", default="record", choices=["record", "raise"],
                     help="on a failed idle leak check: record it and go on, or stop the run")
    run.add_argument("--debug", action="store_true",
                     help="keep the slot ledger live, poison freed KV with NaN and check every read "
                     "(a use-after-free is caught at the read)")
    run.add_argument("--inject", action="append", default=[], metavar="KIND[:RATE]",
                     help="inject a fault into each request with probability RATE (default 1): leak-tail, lock-leak, "
                     "double-free, use-after-free, swa-window-leak; repeatable")
    run.add_argument("--inject-seed", type=int, default=0, help="seed of the fault injection")
    run.add_argument("--no-report", action="store_true",
                     help="at level full, skip building the leak report when the run closes (it replays every "
                     "event, ~7 µs each; the dashboard then replays on demand)")
    run.set_defaults(func=_run)


def build_parser() -> argparse.ArgumentParser:
    from kvscope.planning.cli_verbs import add_plan_parser, add_replay_parser

    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="Observability dashboard and memory debugger for SGLang-style KV-cache memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    demo = verbs.add_parser(
        "demo",
        help="print a live, slot-by-slot demo of the memory pools",
        description="Run requests through the request-to-token pool, the paged allocator, the "
        "KV buffers and the SWA allocator, printing the page map after every step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
    demo.add_argument("--page-size", type=int, default=4, help="tokens per page (>= 2)")
    demo.add_argument("--delay", type=float, default=0.3, help="seconds between steps")
    demo.set_defaults(func=_demo)
    runs = verbs.add_parser(
        "runs",
        help="list the runs recorded in a capture",
        description="List every run in a capture with its status (running, finished, crashed, or "
        "'ended without closing' when the recording process died), level, start time and length.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    runs.add_argument("capture", help="a capture file (SQLite) or a SQLAlchemy URL")
    runs.set_defaults(func=_runs)
    _add_run(verbs)
    _add_debugger(verbs)
    add_plan_parser(verbs)
    add_replay_parser(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvscope.engine.stats import LeakDetected
    from kvscope.telemetry.store import CaptureError

    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except LeakDetected as err:
        print(f"kvscope {args.verb}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    except (ValueError, OSError, CaptureError) as err:
        print(f"kvscope {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvscope {args.verb}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
