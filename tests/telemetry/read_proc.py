"""A reading process for the read-only media tests: opens each capture read-only and prints
one JSON line per capture: its run statuses and event counts, or the CaptureError line."""

from __future__ import annotations

import json
import sys

from kvscope.telemetry.queries import Capture
from kvscope.telemetry.store import CaptureError


def main(paths: list[str]) -> None:
    for path in paths:
        try:
            capture = Capture(path)
            runs = capture.runs()
            out = {
                "statuses": list(runs.status),
                "events": [len(capture.events(int(run_id), limit=10_000_000)) for run_id in runs.id],
            }
            capture.close()
        except CaptureError as err:
            out = {"error": str(err)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
