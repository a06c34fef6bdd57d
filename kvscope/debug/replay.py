"""Rebuild the ledger from a `full` capture, step by step; and resume it as a running
capture grows (the dashboard's Leaks page on a live run replays only what is new).

NOTE: retention. A run whose oldest events were dropped (telemetry/retention.py) is replayed from
its ledger checkpoint (ledger_state.py) when that covers every dropped event, and then reaches the
state a replay from the first event would; otherwise the replay stops with EventsDropped (the
ledger would start from nothing and misread every slot taken before: no verdict may come of it). A
read that fails while the writer drops the chunks it was reading is tried again, from the checkpoint
(or it stops with EventsDropped); one that fails with nothing dropped ahead is a damaged capture.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvscope.debug import ledger_state
from kvscope.debug.ledger import APPLY_COLUMNS, Ledger
from kvscope.telemetry import Capture, CaptureError, EventKind
from kvscope.telemetry.packed import NO_SLOTS, NULL_INT

StepHook = Callable[[int, Ledger], None]  # called when the replay moves past a step
ProgressHook = Callable[[int], None]  # events applied so far
KIND_OF = {kind.value: kind for kind in EventKind}  # a stored kind back to its EventKind
SEQ_AT = APPLY_COLUMNS.index("seq")
READ_TRIES = 3  # NOTE: a read that retention's drops cut short is tried again from where it stopped
FREE = EventKind.FREE.value
MOVES = [EventKind.ALLOC.value, FREE]  # NOTE: the stored kinds a replay applies in runs (_apply_columns)


class EventsDropped(Exception):
    """Events the replay needs were dropped by retention and no ledger checkpoint covers them."""

    def __init__(self, first_step: int, first_seq: int) -> None:
        super().__init__(
            f"events before step {first_step} were dropped by retention before the ledger summarized "
            "them: culprits before it cannot be named"
        )
        self.first_step = first_step
        self.first_seq = first_seq


@dataclass
class Replay:
    """A replay that can be advanced again: `current` is the step of the last event applied,
    whose end the replay has not seen yet (more of its events may still come)."""

    run_id: int
    ledger: Ledger = field(default_factory=Ledger)
    current: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    resumed_from: int | None = None  # NOTE: the checkpoint's last event, when the replay started there
    onset_before: int | None = None  # the onset the checkpoint had found (its ledger broke at that step)

    def advance(
        self, capture: Capture, on_step_end: StepHook | None = None, *, on_progress: ProgressHook | None = None
    ) -> int:
        """Apply the events after the last one applied; `on_step_end` sees every step completed
        on the way. Returns the number of events applied."""
        done = 0
        for attempt in range(READ_TRIES):
            self._resume(capture)
            try:
                for columns in capture.event_column_stream(self.run_id, APPLY_COLUMNS, after_seq=self.ledger.last_seq):
                    seqs = columns["seq"]
                    if len(seqs) and seqs[0] != self.ledger.last_seq + 1:  # NOTE: dropped while being read
                        raise EventsDropped(int(columns["step"][0]), int(seqs[0]))
                    self._apply_columns(columns, on_step_end)
                    done += len(seqs)
                    if on_progress is not None:
                        on_progress(done)
                return done
            except CaptureError:
                if attempt + 1 == READ_TRIES or not self._dropped_ahead(capture):
                    raise
        return done

    def _dropped_ahead(self, capture: Capture) -> bool:
        """Retention dropped events this replay has still to apply: a read that failed meanwhile may
        have read a chunk as it went (its columns gone, its row listed), not a damaged capture."""
        kept = capture.run_retention(self.run_id)
        return kept is not None and int(kept.first_seq) > self.ledger.last_seq + 1

    def _apply_columns(self, columns: dict[str, np.ndarray], on_step_end: StepHook | None) -> None:
        """NOTE: a run of one step's allocs and frees in one pool (not swa) is applied at once
        (Ledger.apply_takes_and_frees); every other event alone, in order."""
        ledger, kind_of = self.ledger, KIND_OF
        kinds, steps, counts = columns["kind"], columns["step"], columns["slot_counts"]
        if not len(kinds):
            return
        pools, moves, starts, ends = _runs(kinds, columns["pool"], steps)
        slot_ends = np.cumsum(np.maximum(counts, 0))
        seqs, slots = columns["seq"], columns["slots"]
        # NOTE: per event, Python values (indexing an array one element at a time costs more than the event)
        step_of, seq_of, node_of = steps.tolist(), seqs.tolist(), columns["node_id"].tolist()
        tokens_of, aux_of, reasons = columns["num_tokens"].tolist(), columns["aux"].tolist(), columns["reason"].tolist()
        kinds_of, pools_of, rids = kinds.tolist(), pools.tolist(), columns["rid"].tolist()
        count_of, slot_end_of, move_of = counts.tolist(), slot_ends.tolist(), moves.tolist()
        frees = kinds == FREE
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            step = step_of[start]
            if step != self.current:
                if on_step_end is not None and self.current is not None:
                    on_step_end(self.current, ledger)
                self.current = step
            first, last = slot_end_of[start] - max(count_of[start], 0), slot_end_of[end - 1]
            if move_of[start]:
                ledger.apply_takes_and_frees(
                    step,
                    str(pools_of[start]),
                    seqs[start:end],
                    frees[start:end],
                    rids[start:end],
                    counts[start:end],
                    slots[first:last],
                )
                continue
            node = node_of[start]
            ledger.apply(
                kind_of[kinds_of[start]],
                step,
                seq_of[start],
                pools_of[start],
                rids[start],
                None if node == NULL_INT else node,
                tokens_of[start],
                aux_of[start],
                None if count_of[start] == NO_SLOTS else slots[first:last],
                reasons[start],
            )

    def _resume(self, capture: Capture) -> None:
        """Start from the run's checkpoint when events after the last one applied were dropped."""
        kept = capture.run_retention(self.run_id)
        if kept is None or int(kept.first_seq) <= self.ledger.last_seq + 1:
            return
        found = capture.ledger_checkpoint(self.run_id)
        first_seq, first_step = int(kept.first_seq), int(kept.first_step)
        if found is None or found.producer != ledger_state.FORMAT or int(found.through_seq) < first_seq - 1:
            raise EventsDropped(first_step, first_seq)
        try:
            self.ledger, extra = ledger_state.decode(bytes(found.body))
        except ValueError:
            raise EventsDropped(first_step, first_seq) from None
        self.current = extra.get("current")
        self.onset_before = extra.get("onset")
        self.resumed_from = self.ledger.last_seq


def _runs(kinds: np.ndarray, pools: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, ...]:
    """The pools (NULL read as full), which events are allocs or frees outside swa, and where the
    runs of those (one step, one pool) and the other events (one each) start and end."""
    pools = np.where(pools == None, "full", pools)  # noqa: E711 (elementwise)
    moves = np.isin(kinds, MOVES) & (pools != "swa")
    apart = (steps[1:] != steps[:-1]) | (pools[1:] != pools[:-1]) | ~moves[1:] | ~moves[:-1]
    starts = np.flatnonzero(np.concatenate([[True], apart]))
    return pools, moves, starts, np.append(starts[1:], len(kinds))


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
