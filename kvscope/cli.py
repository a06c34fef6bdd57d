"""The `kvscope` command. Each verb parses its arguments here and calls into the packages."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from kvscope.mem.demo import run_demo

    run_demo(args.device, args.page_size, args.delay)
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, OSError) as err:
        print(f"kvscope {args.verb}: error: {err}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
