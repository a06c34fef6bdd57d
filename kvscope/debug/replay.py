"""Rebuild the ledger from a `full` capture, step by step; and resume it as a running
capture grows (the dashboard's Leaks page on a live run replays only what is new)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvscope.debug.ledger import APPLY_COLUMNS, Ledger
from kvscope.telemetry import Capture, EventKind

StepHook = Callable[[int, Ledger], None]  # called when the replay moves past a step
ProgressHook = Callable[[int], None]  # events applied so far
KIND_OF = {kind.value: kind for kind in EventKind}  # a stored kind back to its EventKind


@dataclass
class Replay:
    """A replay that can be advanced again: `current` is the step of the last event applied,
    whose end the replay has not seen yet (more of its events may still come)."""

    run_id: int
    ledger: Ledger = field(default_factory=Ledger)
    current: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def advance(
        self, capture: Capture, on_step_end: StepHook | None = None, *, on_progress: ProgressHook | None = None
    ) -> int:
        """Apply the events after the last one applied; `on_step_end` sees every step completed
        on the way. Returns the number of events applied."""
        ledger, done = self.ledger, 0
        apply, empty, kind_of = ledger.apply, np.empty(0, dtype=np.int64), KIND_OF
        for batch in capture.event_stream(self.run_id, APPLY_COLUMNS, after_seq=ledger.last_seq):
            for kind, step, seq, pool, rid, node_id, num_tokens, aux, blob, reason in batch:
                if step != self.current:
                    if on_step_end is not None and self.current is not None:
                        on_step_end(self.current, ledger)
                    self.current = step
                slots = empty if blob is None else np.frombuffer(blob, dtype="<i4").astype(np.int64)
                apply(kind_of[kind], step, seq, pool, rid, node_id, num_tokens, aux, slots, reason)
            done += len(batch)
            if on_progress is not None:
                on_progress(done)
        return done


def replay(
    capture: Capture, run_id: int, on_step_end: StepHook | None = None, *, on_progress: ProgressHook | None = None
) -> Ledger:
    """Apply every event of the run in sequence order; `on_step_end(step, ledger)` sees the
    ledger after each step's last event, `on_progress(events)` is called after each batch."""
    state = Replay(run_id)
    state.advance(capture, on_step_end, on_progress=on_progress)
    if on_step_end is not None and state.current is not None:
        on_step_end(state.current, state.ledger)
    return state.ledger
