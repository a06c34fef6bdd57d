"""A ledger checkpoint (debug/ledger_state.py) carries the whole state: a replay that stops halfway,
goes through encode and decode, and goes on ends where a replay straight through ends (the same
leaks, culprits, onset flags and last event), for every sample capture (radix, a leak, SWA pairs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvscope.debug import ledger_state
from kvscope.debug.ledger import APPLY_COLUMNS, Ledger
from kvscope.debug.replay import KIND_OF
from kvscope.debug.report import _leaks
from kvscope.telemetry import Capture

SAMPLES = Path(__file__).resolve().parents[2] / "sample_runs"


def apply_all(ledger: Ledger, rows: list[tuple]) -> Ledger:
    for kind, step, seq, pool, rid, node_id, num_tokens, aux, blob, reason in rows:
        slots = np.empty(0, np.int64) if blob is None else np.frombuffer(blob, "<i4").astype(np.int64)
        ledger.apply(KIND_OF[kind], step, seq, pool, rid, node_id, num_tokens, aux, slots, reason)
    return ledger


def summary(ledger: Ledger) -> tuple:
    leaks = [(leak.kind, leak.pool, leak.slots, leak.rid, leak.allocated_step, leak.detail) for leak in _leaks(ledger)]
    return leaks, ledger.is_broken(), ledger.last_seq, sorted(ledger.live), len(ledger.node_slots)


@pytest.mark.parametrize("sample", ["leaky.db", "shared-prefix.db", "hybrid-swa.db"])
def test_a_replay_resumed_from_its_state_ends_where_a_straight_replay_ends(sample: str) -> None:
    capture = Capture(SAMPLES / sample)
    try:
        run_id = int(capture.runs().id.iloc[-1])
        rows = [row for batch in capture.event_stream(run_id, APPLY_COLUMNS) for row in batch]
    finally:
        capture.close()
    straight = apply_all(Ledger(), rows)
    half = len(rows) // 2
    restored, extra = ledger_state.decode(ledger_state.encode(apply_all(Ledger(), rows[:half]), {"current": 7}))
    assert extra == {"current": 7}
    assert summary(apply_all(restored, rows[half:])) == summary(straight)


def test_a_body_that_is_not_a_state_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a ledger state"):
        ledger_state.decode(b"not an archive")
