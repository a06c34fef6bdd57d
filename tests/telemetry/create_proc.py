"""A process that starts a run on a capture when told to, for the creation tests: prints
"ready", waits for a line on stdin, then records a few events into a new run and closes it.
With --signals, SIGTERM raises SystemExit as `kvscope run` does."""

from __future__ import annotations

import sys

from kvscope.telemetry import EventKind, PoolName
from kvscope.telemetry.recorder import SQLRecorder, install_signal_handlers

NUM_EVENTS = 100


def main(path: str, signals: bool) -> None:
    if signals:
        install_signal_handlers()
    print("ready", flush=True)
    sys.stdin.readline()
    with SQLRecorder(path, level="full", label="child") as recorder:
        for i in range(NUM_EVENTS):
            recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{i}", num_tokens=1, slots=[i])
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--signals" in sys.argv[2:])
