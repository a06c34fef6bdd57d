"""A recording process for the crash and concurrency tests: records bursts of events,
flushes, and prints how many events are on disk after each flush, until killed."""

from __future__ import annotations

import sys
import time

import numpy as np

from kvscope.telemetry import EventKind, PoolName, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder, install_signal_handlers


def main(path: str, bursts: int) -> None:
    install_signal_handlers()
    slots = np.arange(8, dtype=np.int64)
    with SQLRecorder(path, level="full", label="writer", flush_interval_s=0.05) as recorder:
        total = 0
        for step in range(bursts):
            recorder.step = step
            for _ in range(500):
                recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step}", num_tokens=8, slots=slots)
            recorder.usage(UsageSample(step, PoolTerms(100, 50, 30, 20), None, 4, 2, 2, 0, 0, 0, 0, 0, 0, 0))
            recorder.flush()
            total += 500
            print(f"flushed {total}", flush=True)
            time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
