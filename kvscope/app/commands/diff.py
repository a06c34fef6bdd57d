"""`kvscope diff`: its options; the body is kvscope/app/report.py."""

from __future__ import annotations

import argparse


class DiffCommand:
    name = "diff"
    help = "two runs side by side"
    description = (
        "The verdicts, usage peaks, hit rates, evictions, retractions, the last leak-check terms (held and "
        "missing included), event counts per kind and the settings that differ between the two runs' configs. "
        "A and B may be the same capture, with --run given twice."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("a", help="first capture")
        parser.add_argument("b", help="second capture")
        parser.add_argument(
            "--run",
            type=int,
            action="append",
            metavar="ID",
            help="run id of both captures; given twice, of A then B (default: each capture's latest run)",
        )
        parser.add_argument("--json", action="store_true", help="print both sides, the deltas and the verdicts as JSON")
        parser.add_argument(
            "--replay",
            action="store_true",
            help="replay the capture's events even when the leak report stored at close still describes the run",
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.report import diff_verb

        return diff_verb(args)
