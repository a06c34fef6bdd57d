"""The `kvscope` command: every verb's arguments, and the dispatch to the verb's module.

    demo            demo.py     the pools, slot by slot
    run             runner.py   a workload or trace through the engine into a capture
    runs, report leaks, check, diff
                    report.py   read a capture
    plan, replay    plan.py     capacity on a GPU, hit rate vs cache capacity

A handler returns the exit code. Bad input raises ValueError, OSError or CaptureError with one
line, which `main` prints as `kvscope <verb>: error: <line>` and exits 2; Ctrl-C exits 130.

NOTE: runner.py and demo.py load torch, so they are imported only when their verb runs:
`--help`, the capture readers and the planner never load it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from kvscope.app.plan import plan_verb, replay_verb
from kvscope.app.report import check_verb, diff_verb, report_verb, runs_verb
from kvscope.engine import CACHE_KINDS
from kvscope.planning import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MEM_FRACTION_STATIC,
    EXACTNESS,
    KV_DTYPES,
    PRESETS,
)
from kvscope.telemetry import CaptureError
from kvscope.workloads import WORKLOADS

SubParsers = Any  # argparse._SubParsersAction, private in typeshed
DEFAULTS = argparse.ArgumentDefaultsHelpFormatter
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def _run(args: argparse.Namespace) -> int:
    from kvscope.app.runner import run_verb

    return run_verb(args)


def _demo(args: argparse.Namespace) -> int:
    from kvscope.app.demo import demo_verb

    return demo_verb(args)


def add_demo_parser(verbs: SubParsers) -> None:
    demo = verbs.add_parser(
        "demo",
        help="print a live, slot-by-slot demo of the memory pools",
        description="Run requests through the request-to-token pool, the paged allocator, the "
        "KV buffers and the SWA allocator, printing the page map after every step.",
        formatter_class=DEFAULTS,
    )
    demo.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
    demo.add_argument("--page-size", type=int, default=4, help="tokens per page (>= 2)")
    demo.add_argument("--delay", type=float, default=0.3, help="seconds between steps")
    demo.set_defaults(func=_demo)


def add_runs_parser(verbs: SubParsers) -> None:
    runs = verbs.add_parser(
        "runs",
        help="list the runs recorded in a capture",
        description="List every run in a capture with its status (running, finished, crashed, or "
        "'ended without closing' when the recording process died), level, start time and length.",
        formatter_class=DEFAULTS,
    )
    runs.add_argument("capture", help="a capture file (SQLite) or a SQLAlchemy URL")
    runs.set_defaults(func=runs_verb)


def add_run_parser(verbs: SubParsers) -> None:
    run = verbs.add_parser(
        "run",
        help="run a workload or a trace through the engine and record a capture",
        description="Run requests through the instrumented engine (a tiny seeded transformer on real KV pools) "
        "and record every memory event into a capture. Exit code 1 when an idle leak check failed.",
        formatter_class=DEFAULTS,
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


def add_debugger_parsers(verbs: SubParsers) -> None:
    report = verbs.add_parser("report", help="explain a capture (report leaks CAPTURE)", formatter_class=DEFAULTS,
                              description="Reports over a capture.")
    topics = report.add_subparsers(dest="topic", required=True, metavar="TOPIC")
    leaks = topics.add_parser(
        "leaks", formatter_class=DEFAULTS, help="name the culprits of every leak",
        description="For each leak: the pool, the slots, the request that last owned them and its principal, the "
        "step and event that allocated them, the free that never came, the first failing leak check and the onset "
        "step. A capture recorded below level full has no slot indices: the report says so and works from the "
        "leak checks and the requests table.")
    leaks.add_argument("capture", help="a capture file or a SQLAlchemy URL")
    leaks.add_argument("--run", type=int, help="run id (default: the latest run)")
    leaks.add_argument("--json", action="store_true", help="machine-readable output")
    leaks.set_defaults(func=report_verb)
    check = verbs.add_parser(
        "check", formatter_class=DEFAULTS,
        help="CI gate: exit 0 clean, 1 on a leak or broken invariant, 2 unreadable",
        description="Exit 0 when the capture is clean, 1 on a leak or a broken invariant (with the one-line "
        "reason), 2 when the capture cannot be read.")
    check.add_argument("capture", help="a capture file or a SQLAlchemy URL")
    check.add_argument("--run", type=int, help="run id (default: the latest run)")
    check.set_defaults(func=check_verb)
    diff = verbs.add_parser("diff", formatter_class=DEFAULTS, help="two captures side by side",
                            description="Usage peaks, hit rates, evictions, retractions, the last leak-check terms "
                            "and event counts per kind of the latest run of each capture.")
    diff.add_argument("a", help="first capture")
    diff.add_argument("b", help="second capture")
    diff.set_defaults(func=diff_verb)


def add_plan_parser(verbs: SubParsers) -> None:
    plan = verbs.add_parser(
        "plan",
        help="KV bytes per token and how many tokens / requests fit, for a model on a GPU",
        description="KV-cache capacity of a model on a GPU: bytes per token, SGLang's max_total_num_tokens and "
        "pages, vLLM's GPU blocks, and how many requests of a context length fit at once. GPU memory comes "
        "from NVML for the visible GPUs (the smallest of the first --tp ones), or from --gpu-mem.",
        formatter_class=DEFAULTS,
    )
    plan.add_argument("--model", required=True, metavar="NAME|CONFIG",
                      help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json file")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, metavar="DTYPE",
                      help=f"KV cache dtype ({', '.join(KV_DTYPES)}); auto = the model's dtype")
    plan.add_argument("--gpu-mem", type=float, metavar="GIB",
                      help="memory per GPU in GiB (SGLang: free at start; vLLM: total); default: NVML")
    plan.add_argument("--weights-gib", type=float, metavar="GIB",
                      help="the whole model's weights in GiB (all TP ranks); default: the preset's")
    plan.add_argument("--page-size", type=int, default=1, help="SGLang tokens per page")
    plan.add_argument("--mem-fraction-static", type=float, default=DEFAULT_MEM_FRACTION_STATIC,
                      help="SGLang: share of the memory free at start for weights + KV")
    plan.add_argument("--swa-full-tokens-ratio", type=float, default=0.8,
                      help="SGLang hybrid SWA: SWA pool tokens per full pool token")
    plan.add_argument("--context-len", type=int, default=8192, help="tokens per request (prompt + output)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                      help="vLLM: share of the GPU's total memory for the instance")
    plan.add_argument("--block-size", type=int, default=16, help="vLLM tokens per block")
    plan.add_argument("--vllm-activation-gib", type=float, default=0.0, metavar="GIB",
                      help="vLLM: activation peak of its profile run, subtracted from its KV memory")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=plan_verb)


def add_replay_parser(verbs: SubParsers) -> None:
    replay = verbs.add_parser(
        "replay",
        help="hit rate vs cache capacity for a trace or a capture: replays and the one-pass curve",
        description="Replay a request stream through the radix cache alone (no model) at each capacity, in "
        "parallel processes, and print the hit rate, evicted tokens and peak usage per capacity beside the "
        f"one-pass stack-distance curve ({EXACTNESS}). A capture is replayed by regenerating its run's "
        "request stream from the run's recorded workload config.",
        formatter_class=DEFAULTS,
    )
    replay.add_argument("source", help="a JSONL trace, or a capture (SQLite file or SQLAlchemy URL)")
    replay.add_argument("--capacities", type=parse_capacities, metavar="LIST",
                        help="comma-separated capacities in tokens (200000, 200k, 1.5M), floored to pages; "
                        "default: 12 log-spaced from 1%% to 100%% of the working set")
    replay.add_argument("--page-size", type=int, default=1, help="tokens per KV page (a power of two)")
    replay.add_argument("--eviction", default="page", choices=["page", "leaf"],
                        help="page: only the pages needed, the curve's model; leaf: SGLang's whole leaves")
    replay.add_argument("--convention", default="slots", choices=["slots", "tree"],
                        help="slots: the pool holds CAPACITY slots shared with the request in flight "
                        "(bench_radix); tree: the tree holds CAPACITY tokens between requests (the curve's)")
    replay.add_argument("--policy", default="lru",
                        help="eviction policy: lru, lfu, fifo, mru, filo, priority, slru (the one-pass curve is lru's)")
    replay.add_argument("--workers", type=int, help="worker processes (default: one per capacity, at most the CPUs)")
    replay.add_argument("--run-id", type=int, help="the run of a capture to replay (default: the latest)")
    replay.add_argument("--curve-only", action="store_true", help="only the one-pass curve, no replays")
    replay.add_argument("--json", action="store_true", help="print the results as JSON")
    replay.set_defaults(func=replay_verb)


def parse_capacities(text: str) -> list[int]:
    values = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgG]?)", item)
        if not match:
            raise argparse.ArgumentTypeError(f"{item!r} is not a token count (write 200000, 200k or 1.5M)")
        values.append(int(float(match[1]) * _SUFFIXES[match[2].lower()]))
    if not values:
        raise argparse.ArgumentTypeError("no capacities given")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="Observability dashboard and memory debugger for SGLang-style KV-cache memory.",
        formatter_class=DEFAULTS,
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    add_demo_parser(verbs)
    add_runs_parser(verbs)
    add_run_parser(verbs)
    add_debugger_parsers(verbs)
    add_plan_parser(verbs)
    add_replay_parser(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, OSError, CaptureError) as err:
        print(f"kvscope {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvscope {args.verb}: interrupted", file=sys.stderr)
        return 130
    return code
