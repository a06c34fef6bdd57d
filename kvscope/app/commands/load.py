"""`kvscope load`: its options; the body is kvscope/app/load.py."""

from __future__ import annotations

import argparse

from kvscope.app.commands.base import add_old_spelling
from kvscope.app.units import finite_float, positive_count
from kvscope.workloads import WORKLOADS


class LoadCommand:
    name = "load"
    help = "drive an OpenAI-compatible server (kvscope serve) with a workload or trace"
    description = (
        "Replay a workload or trace against a server's streamed /v1/completions with the official openai "
        "client: prompts as token ids, each request's user in `user`, a session's next turn sent after the "
        "previous one finished. Prints throughput and TTFT, inter-token and end-to-end latency percentiles. "
        "Exit 1 when any request failed, 2 when no server answers."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--url", required=True, help="the server, e.g. http://127.0.0.1:30000 (or its /v1 base URL)"
        )
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload")
        source.add_argument("--trace", metavar="FILE", help="a JSONL trace: one {id, user, prompt, output} per line")
        parser.add_argument(
            "--num-requests",
            type=positive_count,
            metavar="N",
            help="requests to send (default: 100 of a workload, all of a trace; with --duration-s, per "
            "round of the repeated workload)",
        )
        parser.add_argument("--seed", type=int, default=0, help="workload seed (round r of --duration-s uses seed + r)")
        parser.add_argument(
            "--vocab-size", type=positive_count, default=512, help="token ids of a workload lie below this"
        )
        parser.add_argument(
            "--rate",
            type=finite_float(0),
            metavar="R",
            help="requests per second (default: as fast as --concurrency allows)",
        )
        parser.add_argument(
            "--arrivals", default="poisson", choices=["poisson", "even"], help="arrival process with --rate"
        )
        add_old_spelling(
            parser,
            parser.add_argument(
                "--duration-s",
                dest="duration",
                type=finite_float(0),
                metavar="S",
                help="stop sending after S seconds; the workload repeats until then",
            ),
        )
        parser.add_argument(
            "--concurrency", type=positive_count, default=8, metavar="C", help="requests in flight at most"
        )
        parser.add_argument(
            "--api-keys",
            metavar="FILE",
            help="the server's key file; user groups (the id up to its first '-': t1-u2 -> t1) "
            "take the keys "
            "round-robin in order of first appearance; `user` stays the workload's user",
        )
        parser.add_argument(
            "--max-tokens",
            type=positive_count,
            metavar="N",
            help="output tokens per request (default: each request's output length)",
        )
        add_old_spelling(
            parser,
            parser.add_argument(
                "--timeout-s",
                dest="timeout",
                type=finite_float(0),
                default=600.0,
                metavar="S",
                help="HTTP timeout of each request",
            ),
        )
        parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
        parser.add_argument(
            "--json", action="store_true", help="print the summary as JSON (shape: kvscope/app/load.py)"
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.load import load_verb

        return load_verb(args)
