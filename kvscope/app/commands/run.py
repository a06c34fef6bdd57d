"""`kvscope run`: its options; the body is kvscope/app/runner.py."""

from __future__ import annotations

import argparse

from kvscope.app.commands.base import add_old_spelling
from kvscope.app.commands.engine_options import add_engine_options
from kvscope.app.commands.retention_options import add_retention_options
from kvscope.app.units import finite_float, positive_count
from kvscope.workloads import WORKLOADS


class RunCommand:
    name = "run"
    help = "run a workload or a trace through the engine and record a capture"
    description = (
        "Run requests through the instrumented engine (a tiny seeded transformer on real KV pools) and record "
        "every memory event into a capture. Exit code 1 when an idle leak check failed."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload")
        source.add_argument("--trace", metavar="FILE", help="a JSONL trace: one {id, user, prompt, output} per line")
        parser.add_argument(
            "--num-requests", type=positive_count, default=64, help="requests to generate (with --workload)"
        )
        parser.add_argument("--seed", type=int, default=0, help="workload seed")
        add_engine_options(parser)
        parser.add_argument(
            "--level",
            default="full",
            choices=["off", "summary", "full"],
            help="summary: usage, requests, leak checks, tree snapshots; full: plus every memory event",
        )
        parser.add_argument("--capture", metavar="PATH", help="capture file (default runs/<time>-<workload>.db)")
        add_retention_options(parser)
        add_old_spelling(
            parser,
            parser.add_argument(
                "--rate",
                dest="pace",
                type=finite_float(0),
                metavar="R",
                help="requests per second, arriving in real time; without it all requests arrive at once",
            ),
        )
        parser.add_argument(
            "--leak-check",
            default="record",
            choices=["record", "raise"],
            help="on a failed idle leak check: record it and go on, or stop the run",
        )
        parser.add_argument(
            "--debug",
            action="store_true",
            help="keep the slot ledger live, poison freed KV with NaN and check every read "
            "(a use-after-free is caught at the read)",
        )
        parser.add_argument(
            "--inject",
            action="append",
            default=[],
            metavar="KIND[:RATE]",
            help="inject a fault into each request with probability RATE (default 1): "
            "leak-tail, lock-leak, "
            "double-free, use-after-free, swa-window-leak; host-leak (--cache hiradix) into each host "
            "copy leaving the tree; repeatable",
        )
        parser.add_argument("--inject-seed", type=int, default=0, help="seed of the fault injection")
        parser.add_argument(
            "--no-report",
            action="store_true",
            help="at level full, skip building the leak report when the run closes (it replays every "
            "event, ~7 µs each; the dashboard then replays on demand)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.runner import run_verb

        return run_verb(args)
