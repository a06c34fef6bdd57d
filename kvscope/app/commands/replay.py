"""`kvscope replay`: its options; the body is kvscope/app/plan.py."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from kvscope.app.commands.base import add_old_spelling
from kvscope.app.commands.engine_options import POLICY_HELP, add_scoped_options
from kvscope.app.units import token_counts
from kvscope.planning import EXACTNESS


class ReplayCommand:
    name = "replay"
    help = "hit rate vs cache capacity for a trace or a capture: replays and the one-pass curve"
    description = (
        "Replay a request stream through the radix cache alone (no model) at each capacity, in "
        "parallel processes, and print the hit rate, evicted tokens and peak usage per capacity beside the "
        f"one-pass stack-distance curve ({EXACTNESS}). A capture is replayed by regenerating its run's "
        "request stream from the run's recorded workload config."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("source", help="a JSONL trace, or a capture (SQLite file or SQLAlchemy URL)")
        parser.add_argument(
            "--capacities",
            type=token_counts,
            metavar="LIST",
            help="comma-separated capacities in tokens (200000, 200k, 1.5M, 128Ki), floored to pages; "
            "default: 12 log-spaced from 1%% to 100%% of the working set, none below the longest "
            "request under the slots convention",
        )
        parser.add_argument(
            "--page-size", type=int, help="tokens per KV page (a power of two); default: a capture's own, else 1"
        )
        add_old_spelling(
            parser,
            parser.add_argument(
                "--eviction-granularity",
                dest="eviction",
                default="page",
                choices=["page", "leaf"],
                help="page: only the pages needed (unlike run and serve, which follow SGLang's leaf: the one-pass "
                "curve is exact only for page); leaf: SGLang's whole leaves",
            ),
        )
        parser.add_argument(
            "--convention",
            default="slots",
            choices=["slots", "tree"],
            help="slots: the pool holds CAPACITY slots shared with the request in flight "
            "(bench_radix); tree: the tree holds CAPACITY tokens between requests (the curve's)",
        )
        add_old_spelling(
            parser,
            parser.add_argument(
                "--eviction-policy", dest="policy", default="lru", help=f"{POLICY_HELP} (the one-pass curve is lru's)"
            ),
        )
        parser.add_argument(
            "--cache",
            default="radix",
            choices=["radix", "scoped-radix"],
            help="radix: global sharing; scoped-radix: each request's user is its principal, replayed "
            "beside global sharing, with the isolated one-pass curve (keys per principal) beside "
            "the global one",
        )
        add_scoped_options(parser, "trace time (a request's arrival_s; a trace without arrival times: its index x 1 s)")
        parser.add_argument(
            "--workers", type=int, help="worker processes (default: one per capacity, at most the CPUs)"
        )
        parser.add_argument("--run", type=int, help="the run of a capture to replay (default: the latest)")
        parser.add_argument("--run-id", type=int, dest="run", help=argparse.SUPPRESS)  # NOTE: the old name
        parser.add_argument("--curve-only", action="store_true", help="only the one-pass curve, no replays")
        parser.add_argument(
            "--dp-size",
            type=int,
            help="route the trace among this many radix caches of --capacities tokens each (one value) and print "
            "per replica hit rate, routing loss and duplicated tokens (docs/fleet.md)",
        )
        parser.add_argument(
            "--dispatch",
            metavar="METHOD",
            help="with --dp-size: round_robin, total_requests, total_tokens, prefix_affinity or all (default: all)",
        )
        parser.add_argument("--json", action="store_true", help="print the results as JSON")

    def run(self, args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
        """out, err: where the body writes (a test's buffers); default the process's streams, read at
        call time (the body's own defaults were bound when it was first imported)."""
        from kvscope.app.plan import replay_verb

        return replay_verb(args, sys.stdout if out is None else out, sys.stderr if err is None else err)
