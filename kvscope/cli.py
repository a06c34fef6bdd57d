"""The `kvscope` command. Each verb parses its arguments here and calls into the packages."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


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
    runs = verbs.add_parser(
        "runs",
        help="list the runs recorded in a capture",
        description="List every run in a capture with its status (running, finished, crashed, or "
        "'ended without closing' when the recording process died), level, start time and length.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    runs.add_argument("capture", help="a capture file (SQLite) or a SQLAlchemy URL")
    runs.set_defaults(func=_runs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvscope.telemetry.store import CaptureError

    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, OSError, CaptureError) as err:
        print(f"kvscope {args.verb}: error: {err}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
