"""`kvscope check`: its options; the body is kvscope/app/report.py."""

from __future__ import annotations

import argparse


class CheckCommand:
    name = "check"
    help = "CI gate: exit 0 clean, 1 leak, 2 unreadable, 3 inconclusive"
    description = (
        "Print one line and exit with the verdict: 0 clean (the run finished and passed at least one idle "
        "leak check, with nothing failing); 1 a leak or a broken invariant; 2 the capture cannot be read (or "
        "bad input); 3 inconclusive: the run was interrupted, crashed, is incomplete (recording stopped), is "
        "still running or ended without closing, or never reached an idle leak check. See docs/cli.md."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        # NOTE: optional only so that `check --fleet CAPTURE` (the fleet's ID left out) reads as `check CAPTURE --fleet`
        parser.add_argument("capture", nargs="?", help="a capture file or a SQLAlchemy URL")
        parser.add_argument("--run", type=int, help="run id (default: the latest run)")
        parser.add_argument(
            "--fleet",
            nargs="?",
            const="",
            metavar="ID",
            help="check every replica of a fleet (kvscope serve --dp-size, an instrumented engine's DP ranks; "
            "default: the capture's latest fleet): one line per replica, and the worst verdict is the exit code",
        )
        parser.add_argument("--json", action="store_true", help="print the verdict as JSON (the exit code is the same)")
        parser.add_argument(
            "--replay",
            action="store_true",
            help="replay the capture's events even when the leak report stored at close still describes the run",
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.report import check_verb

        if args.capture is None:
            if not args.fleet:
                raise ValueError("name the capture to check: kvscope check CAPTURE [--fleet [ID]]")
            args.capture, args.fleet = args.fleet, ""  # NOTE: --fleet took the capture as its ID

        return check_verb(args)
