"""`kvscope demo`: its options; the body is kvscope/app/demo.py."""

from __future__ import annotations

import argparse

from kvscope.app.commands.base import add_old_spelling
from kvscope.app.units import finite_float


class DemoCommand:
    name = "demo"
    help = "print a live, slot-by-slot demo of the memory pools"
    description = (
        "Run requests through the request-to-token pool, the paged allocator, the KV buffers and the SWA "
        "allocator, printing the page map after every step."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
        parser.add_argument("--page-size", type=int, default=4, help="tokens per page (>= 2)")
        add_old_spelling(
            parser,
            parser.add_argument(
                "--delay-s",
                dest="delay",
                type=finite_float(0, low_open=False),
                default=0.3,
                help="seconds between steps",
            ),
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.demo import demo_verb

        return demo_verb(args)
