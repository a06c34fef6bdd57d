"""`kvscope upgrade CAPTURE`: pack the event rows of runs recorded before schema version 6.

Reading never needs it (readers read both layouts); it makes an older capture as fast to
read as a new one and usually smaller. One line per packed run, or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvscope.app.progress import Progress, bar
from kvscope.telemetry.store import display_name
from kvscope.telemetry.upgrade import upgrade

PROGRESS_DELAY_S = 1.0


def upgrade_verb(args: argparse.Namespace) -> int:
    progress = Progress(sys.stderr, delay_s=PROGRESS_DELAY_S)

    def on_progress(run_id: int, done: int, total: int) -> None:
        if progress.due():
            progress.draw(f"packing run {run_id}: {bar(done, total)} {done:,}/{total:,} events ")

    try:
        packed = upgrade(args.capture, progress=on_progress)
    finally:
        progress.close()
    name = display_name(args.capture)
    if args.json:
        print(
            json.dumps(
                {
                    "capture": name,
                    "runs": [{"run": r.run_id, "events": r.events, "chunks": r.chunks} for r in packed],
                },
                indent=2,
            )
        )
    elif not packed:
        print(f"{name}: nothing to upgrade (every run is packed already)")
    else:
        for r in packed:
            chunks = "1 chunk" if r.chunks == 1 else f"{r.chunks:,} chunks"
            print(f"{name}: run {r.run_id}: {r.events:,} events packed into {chunks}")
    return 0
