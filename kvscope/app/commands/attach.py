"""`kvscope attach`: its options; the body is kvscope/app/attach.py."""

from __future__ import annotations

import argparse

from kvscope.app.commands.retention_options import SERVE_MAX_SIZE, add_retention_options
from kvscope.app.units import finite_float


class AttachCommand:
    name = "attach"
    help = "watch a running SGLang, vLLM or kvscope server and record its KV cache into a capture"
    description = (
        "Discover the server at --url (SGLang, vLLM or kvscope serve), subscribe to its KV-event stream "
        "(--kv-events, or the endpoint SGLang and kvscope advertise) and scrape its /metrics every "
        "--scrape-s: the cached pages per tier, evictions and usage go into a capture the dashboard opens "
        "(docs/attach.md). Ends at --duration-s or on SIGINT/SIGTERM/SIGHUP (exit 0, capture closed "
        "'finished'); exit 1 when the server stopped answering or attach itself failed (capture 'crashed'), 2 "
        "on bad input (an unreachable URL, a bad endpoint, a capture older than schema 5)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
        parser.add_argument(
            "--kv-events",
            metavar="ENDPOINT",
            help="the KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557 or ipc:///tmp/kv.sock "
            "(default: what the server advertises; vLLM advertises none: metrics only)",
        )
        parser.add_argument(
            "--replay",
            metavar="ENDPOINT",
            help="the replay endpoint: the history before attaching and gaps are asked of it",
        )
        parser.add_argument("--topic", help="the stream's topic (default: the advertised one, else all)")
        parser.add_argument(
            "--bind", action="store_true", help="bind the SUB socket at --kv-events (for publishers that connect)"
        )
        parser.add_argument(
            "--engine",
            default="auto",
            choices=["auto", "sglang", "vllm", "kvscope"],
            help="what runs behind --url; auto asks it",
        )
        parser.add_argument(
            "--capture",
            metavar="PATH",
            help="capture file, new or made by kvscope schema 5 or newer (default runs/<time>-attach-<engine>.db)",
        )
        add_retention_options(parser, default_max_size=SERVE_MAX_SIZE)
        parser.add_argument(
            "--scrape-s",
            type=finite_float(0),
            default=2.0,
            metavar="S",
            help="seconds between scrapes of /metrics (one step of the capture)",
        )
        parser.add_argument(
            "--duration-s",
            type=finite_float(0),
            metavar="S",
            help="stop after S seconds (default: until SIGINT or SIGTERM)",
        )
        parser.add_argument(
            "--timeout-s",
            type=finite_float(0),
            default=5.0,
            metavar="S",
            help="HTTP timeout of discovery and each scrape",
        )
        parser.add_argument("--json", action="store_true", help="print the summary at the end as JSON")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.attach import attach_verb

        return attach_verb(args)
