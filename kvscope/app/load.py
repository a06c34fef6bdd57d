"""`kvscope load`: replay a workload or trace against an OpenAI-compatible server (kvscope serve,
or any server with streamed /v1/completions that takes token-id prompts).

How requests are sent (sessions, rates, API keys): kvscope/server/load.py. The verb prints the
totals and latency percentiles at the end, progress on stderr while it runs. Exit codes: 0 when
every request succeeded, 1 when any failed, 2 for bad input or no server at the URL, 130 on
Ctrl-C, 143 on SIGTERM (after printing what it gathered).

`--json` prints one object:

    {"url", "model", "concurrency", "rate" (null: as fast as concurrency allows),
     "interrupted" (bool), "wall_s",
     "requests": {"planned", "sent", "completed", "failed"},
     "first_error" (one line or null),
     "throughput": {"requests_per_s", "output_tokens_per_s", "prompt_tokens_per_s"},
     "tokens": {"prompt", "cached", "completion", "cache_hit_rate" (cached / prompt, or null)},
     "ttft_s" | "itl_s" | "e2e_s": {"mean", "p50", "p90", "p99", "max"} (seconds, null without data)}

"planned": the workload's or trace's requests (with --duration-s: those sent); "sent": dispatched,
counting requests a stop signal cancelled in flight; latencies and tokens are over the
completed requests; `itl_s` pools the gaps between streamed chunks of every request.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable

from kvscope.server.load import LoadConfig, ServerUnavailable, format_summary, read_api_keys, run_load, summarize
from kvscope.workloads import TraceRequest, generate, read_trace

DEFAULT_NUM_REQUESTS = 100
TRACE_VOCAB_SIZE = 2**31 - 1  # the server checks ids against its own vocabulary


def rounds_of(args: argparse.Namespace) -> tuple[int, Callable[[int], list[TraceRequest]]]:
    """(requests per round, round -> requests); round r of a workload uses seed + r."""
    num = args.num_requests or DEFAULT_NUM_REQUESTS
    if args.trace:
        trace = read_trace(args.trace, TRACE_VOCAB_SIZE)
        if args.num_requests:
            trace = trace[: args.num_requests]
        return len(trace), lambda _round: trace
    first = generate(args.workload, num_requests=num, seed=args.seed, vocab_size=args.vocab_size)

    def round_requests(r: int) -> list[TraceRequest]:
        return (
            first
            if r == 0
            else generate(args.workload, num_requests=num, seed=args.seed + r, vocab_size=args.vocab_size)
        )

    return num, round_requests


def load_verb(args: argparse.Namespace) -> int:
    _, rounds = rounds_of(args)
    config = LoadConfig(
        url=args.url,
        concurrency=args.concurrency,
        rate=args.rate,
        arrivals=args.arrivals,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        keys=read_api_keys(args.api_keys) if args.api_keys else [],
        seed=args.seed,
        timeout_s=args.timeout,
    )
    try:
        report = run_load(rounds, config, progress=None if args.quiet else sys.stderr)
    except ServerUnavailable as err:
        print(f"kvscope load: error: {err}", file=sys.stderr)
        return 2
    summary = summarize(report)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if report.interrupted:
        print("kvscope load: interrupted", file=sys.stderr)
        return 128 + (report.stop_signal or signal.SIGINT)
    return 0 if summary["requests"]["failed"] == 0 else 1
