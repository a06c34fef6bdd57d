"""A recording process for the concurrent-writer tests: waits until `start_at` (unix seconds) so that
every process opens the database at once (schema creation races), records `num_events` events of
request `label` (slots encode the event's number), then closes its run and prints its id."""

from __future__ import annotations

import sys
import time

import numpy as np

from kvscope.telemetry import EventKind, PoolName, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder

EVENTS_PER_STEP = 1_000


def main(url: str, label: str, num_events: int, start_at: float) -> None:
    time.sleep(max(0.0, start_at - time.time()))
    with SQLRecorder(url, level="full", label=label) as recorder:
        for first in range(0, num_events, EVENTS_PER_STEP):
            recorder.step = first // EVENTS_PER_STEP
            for i in range(first, min(num_events, first + EVENTS_PER_STEP)):
                recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=label, num_tokens=2, slots=np.array([i, -i]))
            recorder.usage(UsageSample(recorder.step, PoolTerms(100, 50, 30, 20), None, 4, 2, 2, 0, 0, 0, 0, 0, 0, 0))
    print(recorder.run_id, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
