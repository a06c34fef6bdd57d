"""`kvscope upgrade CAPTURE`: pack the event rows of runs recorded before schema version 6, and store
the summaries of event chunks written before version 10, the request sums of runs written before 12 and
the fold of a run's chunk summaries (one row) of runs written before 14.

Reading never needs it (readers read both layouts); it makes an older capture as fast to
read as a new one and usually smaller. One line per packed run, or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvscope.app.progress import Progress, bar
from kvscope.telemetry.store import display_name
from kvscope.telemetry.upgrade import UpgradedRun, upgrade

PROGRESS_DELAY_S = 1.0


def upgrade_verb(args: argparse.Namespace) -> int:
    progress = Progress(sys.stderr, delay_s=PROGRESS_DELAY_S)

    def on_progress(run_id: int, done: int, total: int) -> None:
        if progress.due():
            progress.draw(f"packing run {run_id}: {bar(done, total)} {done:,}/{total:,} events ")

    def on_summary(run_id: int, done: int, total: int) -> None:
        if progress.due():
            progress.draw(f"summarizing run {run_id}: {bar(done, total)} {done:,}/{total:,} chunks ")

    def on_sums(run_id: int, done: int, total: int) -> None:
        if progress.due():
            progress.draw(f"summing the requests of run {run_id}: {bar(done, total)} {done:,}/{total:,} requests ")

    def on_fold(run_id: int, done: int, total: int) -> None:
        if progress.due():
            progress.draw(f"folding the summaries of run {run_id}: {bar(done, total)} {done:,}/{total:,} chunks ")

    try:
        packed = upgrade(args.capture, progress=on_progress, summarizing=on_summary, summing=on_sums, folding=on_fold)
    finally:
        progress.close()
    name = display_name(args.capture)
    if args.json:
        print(
            json.dumps(
                {
                    "capture": name,
                    "runs": [
                        {
                            "run": r.run_id,
                            "events": r.events,
                            "chunks": r.chunks,
                            "summarized_chunks": r.summarized,
                            "summed_requests": r.requests_summed,
                            "folded_chunks": r.folded,
                        }
                        for r in packed
                    ],
                },
                indent=2,
            )
        )
    elif not packed:
        print(f"{name}: nothing to upgrade (every run is packed already)")
    else:
        for r in packed:
            print(f"{name}: run {r.run_id}: {_done(r)}")
    return 0


def _done(run: UpgradedRun) -> str:
    chunks = "1 chunk" if run.chunks == 1 else f"{run.chunks:,} chunks"
    packed = f"{run.events:,} events packed into {chunks}" if run.events else ""
    summarized = f"summaries of {run.summarized:,} chunk(s) stored" if run.summarized else ""
    summed = "" if run.requests_summed is None else f"sums of {run.requests_summed:,} request(s) stored"
    folded = f"summaries of {run.folded:,} chunk(s) folded into one row" if run.folded else ""
    return "; ".join(part for part in (packed, summarized, summed, folded) if part) or "up to date"
