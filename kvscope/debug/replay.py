"""Rebuild the ledger from a `full` capture, step by step."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvscope.debug.ledger import Ledger
from kvscope.telemetry.queries import Capture

StepHook = Callable[[int, Ledger], None]  # called when the replay moves past a step
ProgressHook = Callable[[int], None]  # events applied so far


def replay(capture: Capture, run_id: int, on_step_end: StepHook | None = None, *,
           on_progress: ProgressHook | None = None) -> Ledger:
    """Apply every event of the run in sequence order; `on_step_end(step, ledger)` sees the
    ledger after each step's last event, `on_progress(events)` is called after each batch."""
    ledger, current, done = Ledger(), None, 0
    apply, empty = ledger.apply, np.empty(0, dtype=np.int64)
    for batch in capture.event_stream(run_id):
        for kind, step, seq, pool, rid, node_id, num_tokens, aux, blob in batch:
            if step != current:
                if on_step_end is not None and current is not None:
                    on_step_end(current, ledger)
                current = step
            slots = empty if blob is None else np.frombuffer(blob, dtype="<i4").astype(np.int64)
            apply(kind, step, seq, pool, rid, node_id, num_tokens, aux, slots)
        done += len(batch)
        if on_progress is not None:
            on_progress(done)
    if on_step_end is not None and current is not None:
        on_step_end(current, ledger)
    return ledger
