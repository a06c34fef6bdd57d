"""`kvscope upgrade`: its options; the body is kvscope/app/upgrade.py."""

from __future__ import annotations

import argparse


class UpgradeCommand:
    name = "upgrade"
    help = "pack an older capture's events (schema 6)"
    description = (
        "Pack the event rows of every run recorded before schema version 6 into chunks of columns, in place, "
        "one transaction per run (a kill leaves each run whole, as rows or as chunks). Readers read both "
        "layouts, so this is never needed to open a file: it makes an older capture as fast to read as a new "
        "one. It also stores what later versions keep beside the events (chunk summaries, schema 10 and 11; "
        "request sums, schema 12) for the runs written before them. A run still being recorded is refused. "
        "Exit 0 done, 2 the capture cannot be upgraded. See docs/captures.md."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("capture", help="a capture file or a SQLAlchemy URL")
        parser.add_argument("--json", action="store_true", help="print what was packed as JSON")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.upgrade import upgrade_verb

        return upgrade_verb(args)
