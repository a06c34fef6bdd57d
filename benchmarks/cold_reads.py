"""The telemetry reads behind the dashboard's whole-run sums, each timed once on a fresh Capture (no
Streamlit, no cache): for a capture too large to render every page in the time at hand, and to say
which read a slow page waits on.

    .venv/bin/python benchmarks/cold_reads.py CAPTURE READ [READ ...]    (CAPTURE: a file or a database URL)

READ is one of the names in `reads` (`usage_refresh`: a second read by the same reader, as a live
page's refresh makes it; on a file no writer appends to, the buckets its first read left open).
It writes no figures: add them to RESULTS.md with _results.py, naming this command.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def reads(capture: Any, run_id: int) -> dict[str, Callable[[], Any]]:
    from kvscope import telemetry

    return {
        "run_principals": lambda: telemetry.run_principals(capture, run_id),
        "event_counts": lambda: capture.event_counts(run_id),
        "eviction_summary": lambda: telemetry.eviction_summary(capture, run_id),
        "reuse_by_principal": lambda: telemetry.reuse_by_principal(capture, run_id),
        "lookup_stops": lambda: telemetry.lookup_stops(capture, run_id),
        "request_principals": lambda: capture.request_principals(run_id),
        "usage": lambda: capture.usage(run_id, 600),
        "usage_refresh": lambda: capture.usage(run_id, 600),  # NOTE: after FIRST's read by the same reader
        "latest_usage": lambda: capture.latest_usage(run_id),
        "request_times": lambda: capture.request_rows(
            run_id, columns=["arrive_t", "admit_t", "first_token_t", "finish_t"], ordered=False
        ),
        "request_timeline": lambda: telemetry.allocs_of_requests(
            capture, run_id, list(capture.request_rows(run_id, columns=["rid"], limit=60)["rid"])
        ),
        "request_totals": lambda: capture.request_totals(run_id),
        "request_latency_histograms": lambda: capture.request_latency_histograms(run_id),
        "evictions_over_steps": lambda: telemetry.evictions_over_steps(capture, run_id, 600),
        "held_locks": lambda: telemetry.held_locks(capture, run_id, last_step(capture, run_id)),
        "eviction_log": lambda: telemetry.eviction_log(capture, run_id, 200, 0),
        "latest_snapshot": lambda: capture.tree_at(run_id, capture.snapshot_steps(run_id)[-1]),
        "running_lengths": lambda: telemetry.running_lengths(capture, run_id, last_step(capture, run_id)),
    }


# NOTE: reads timed as a live page's refresh: the same reader read them once first (untimed)
FIRST = {"usage_refresh": "usage"}


def last_step(capture: Any, run_id: int) -> int:
    """The run's last step (the pages' default), from its step range (not timed apart)."""
    return int(capture.step_range(run_id).hi.iloc[0])


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    sys.path.insert(0, str(ROOT))
    from kvscope.telemetry import Capture

    for name in sys.argv[2:]:
        capture = Capture(sys.argv[1])
        try:
            run_id = int(capture.runs().id.iloc[-1])
            every = reads(capture, run_id)
            read = every[name]
            if name in FIRST:
                every[FIRST[name]]()
            start = time.perf_counter()
            found = read()
            took = time.perf_counter() - start
        finally:
            capture.close()
        print(f"{name}: {took:.2f} s ({len(found):,} rows); load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
