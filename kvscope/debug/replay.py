"""Rebuild the ledger from a `full` capture, step by step."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvscope.debug.ledger import Ledger
from kvscope.telemetry.queries import Capture

PAGE_ROWS = 200_000
StepHook = Callable[[int, Ledger], None]  # called when the replay moves past a step


def replay(capture: Capture, run_id: int, on_step_end: StepHook | None = None) -> Ledger:
    """Apply every event of the run in sequence order; `on_step_end(step, ledger)` sees the
    ledger after each step's last event."""
    ledger = Ledger()
    offset, current = 0, None
    while True:
        page = capture.events(run_id, limit=PAGE_ROWS, offset=offset)
        if page.empty:
            break
        for row in page.itertuples(index=False):
            if on_step_end is not None and current is not None and row.step != current:
                on_step_end(current, ledger)
            current = row.step
            slots = None if row.slots is None else np.frombuffer(row.slots, dtype="<i4").astype(np.int64)
            node = None if row.node_id is None or row.node_id != row.node_id else int(row.node_id)
            ledger.apply(row.kind, int(row.step), int(row.seq), row.pool, row.rid, node, int(row.num_tokens),
                         int(row.aux), slots)
        offset += len(page)
    if on_step_end is not None and current is not None:
        on_step_end(current, ledger)
    return ledger
