"""`kvscope runs`: its options; the body is kvscope/app/report.py."""

from __future__ import annotations

import argparse


class RunsCommand:
    name = "runs"
    help = "list the runs recorded in a capture"
    description = (
        "List every run in a capture with its status (running, finished, interrupted, crashed, incomplete, or "
        "'ended without closing' when the recording process died), level, start time, length and error line."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("capture", help="a capture file (SQLite) or a SQLAlchemy URL")
        parser.add_argument("--run", type=int, help="only this run id (default: every run)")
        parser.add_argument("--json", action="store_true", help="print the runs as JSON (shape: docs/cli.md)")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.report import runs_verb

        return runs_verb(args)
