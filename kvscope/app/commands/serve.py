"""`kvscope serve`: its options; the body is kvscope/app/serve.py."""

from __future__ import annotations

import argparse

from kvscope.app.commands.engine_options import add_engine_options
from kvscope.app.commands.retention_options import SERVE_MAX_SIZE, add_retention_options
from kvscope.app.units import port_number
from kvscope.fleet.dispatch import DISPATCH_METHODS


class ServeCommand:
    name = "serve"
    help = "serve the engine over HTTP: OpenAI's completions and chat, /metrics, KV events"
    description = (
        "An OpenAI-compatible server on the engine (docs/serve.md): the HTTP front tokenizes and streams, a "
        "scheduler process runs the engine and records the capture. Prints 'ready on URL' when it serves; "
        "SIGINT or SIGTERM finish the requests in flight, close the capture and exit 0."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
        parser.add_argument("--port", type=port_number, default=30000, help="port to listen on (0: any free port)")
        add_engine_options(parser)
        parser.add_argument("--capture", metavar="PATH", help="capture file (default runs/<time>-serve.db)")
        add_retention_options(parser, default_max_size=SERVE_MAX_SIZE)
        parser.add_argument(
            "--level",
            default="full",
            choices=["off", "summary", "full"],
            help="off: no capture; summary: usage, requests, leak checks, tree snapshots; full: plus "
            "every memory event",
        )
        parser.add_argument(
            "--api-keys",
            metavar="FILE",
            help='JSON {key: {"tenant": T, "user": U}}: requests need "Authorization: Bearer KEY"',
        )
        parser.add_argument(
            "--dp-size",
            type=int,
            default=1,
            metavar="N",
            help="data-parallel ranks: N scheduler processes, each its own engine, memory and run in the capture",
        )
        parser.add_argument(
            "--load-balance-method",
            default="round_robin",
            choices=DISPATCH_METHODS,
            help="how the front picks a rank for each request (with --dp-size > 1); prefix_affinity: the rank "
            "holding the longest prefix of the prompt",
        )
        parser.add_argument(
            "--kv-events-config",
            metavar="JSON",
            help='SGLang\'s KV-event publisher config, e.g. \'{"publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.serve import serve_verb

        return serve_verb(args)
