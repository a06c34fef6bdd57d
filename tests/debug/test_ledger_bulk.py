"""A replay applies a step's run of allocs and frees in one pool at once (Ledger.apply_takes_and_frees,
PoolLedger.take_and_free): the ledger it leaves, and the 'broken so far' flag after every step, are
those of apply() on each event in turn, whatever the events (double frees, a slot twice in one event,
allocs without a request, SWA pairs, other kinds between them), and on the sample captures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.debug.ledger import APPLY_COLUMNS, Ledger
from kvscope.debug.replay import KIND_OF, Replay
from kvscope.debug.slot_table import PoolLedger
from kvscope.telemetry import Capture
from kvscope.telemetry.event_source import row_columns

SAMPLES = Path(__file__).resolve().parents[2] / "sample_runs"
KINDS = ["alloc", "alloc", "alloc", "free", "free", "free", "admit", "finish", "insert", "evict"]


def one_at_a_time(rows: list[tuple]) -> tuple[Ledger, list[tuple[int, bool]]]:
    ledger, broken, current = Ledger(), [], None
    for kind, step, seq, pool, rid, node_id, num_tokens, aux, blob, reason in rows:
        if step != current and current is not None:
            broken.append((current, ledger.is_broken()))
        current = step
        slots = np.empty(0, np.int64) if blob is None else np.frombuffer(blob, "<i4").astype(np.int64)
        ledger.apply(KIND_OF[kind], step, seq, pool, rid, node_id, num_tokens, aux, slots, reason)
    return ledger, broken


def in_runs(rows: list[tuple], batch_rows: int) -> tuple[Ledger, list[tuple[int, bool]]]:
    replay, broken = Replay(1), []
    for start in range(0, len(rows), batch_rows):
        replay._apply_columns(
            row_columns(rows[start : start + batch_rows], APPLY_COLUMNS),
            lambda step, ledger: broken.append((step, ledger.is_broken())),
        )
    return replay.ledger, broken


def state(ledger: Ledger) -> tuple:
    """Everything a checkpoint keeps (ledger_state.encode), the pools' arrays cut to one length."""
    pools = {}
    for name, table in ledger.pools.items():
        used = int(np.flatnonzero((table.kind != 0) | (table.freed_seq != -1) | (table.seq != -1)).max(initial=-1)) + 1
        pools[name] = [getattr(table, f)[:used].tolist() for f, _ in PoolLedger.FIELDS]
    owners = ledger.owners
    held = {k: {r: n for r, n in t.items() if n} for k, t in owners.held.items()}
    pending = [(rid, slots.tolist()) for rid, slots in ledger.pending()]
    return (
        pools,
        held,
        sorted(owners.touched),
        sorted(owners.orphaned),
        ledger.rids,
        sorted(ledger.live),
        ledger.ended,
        [tuple(d) for d in ledger.double_frees],
        ledger.full_to_swa,
        ledger.last_seq,
        pending,
    )


@st.composite
def events(draw: st.DrawFn) -> list[tuple]:
    rows, step = [], 0
    for seq in range(draw(st.integers(1, 120))):
        step += draw(st.sampled_from([0, 0, 0, 1]))
        kind = draw(st.sampled_from(KINDS))
        pool = draw(st.sampled_from([None, "full", "full", "host", "swa"]))
        rid = draw(st.sampled_from([None, "a", "b", "c", "d"]))
        # NOTE: sometimes past slot_table.SMALL_MOVE, so the array paths (one owner, no slot twice) run too
        slots = draw(st.lists(st.integers(0, 40), max_size=6) | st.lists(st.integers(0, 90), min_size=17, max_size=40))
        blob = None if not slots and draw(st.booleans()) else np.asarray(slots, "<i4").tobytes()
        node_id = draw(st.integers(1, 3)) if kind in ("insert", "evict") else None
        rows.append((kind, step, seq, pool, rid, node_id, len(slots), 0, blob, None))
    return rows


@settings(max_examples=100, deadline=None)
@given(events(), st.integers(1, 50))
def test_runs_of_allocs_and_frees_leave_the_ledger_one_at_a_time_leaves(rows: list[tuple], batch_rows: int) -> None:
    expected, expected_broken = one_at_a_time(rows)
    got, got_broken = in_runs(rows, batch_rows)
    assert got_broken == expected_broken
    assert state(got) == state(expected)
    got.check_integrity()


@pytest.mark.parametrize("sample", ["leaky.db", "shared-prefix.db", "hybrid-swa.db"])
def test_a_sample_capture_replays_to_the_same_ledger(sample: str) -> None:
    capture = Capture(SAMPLES / sample)
    try:
        run_id = int(capture.runs().id.iloc[-1])
        rows = [row for batch in capture.event_stream(run_id, APPLY_COLUMNS) for row in batch]
        replay = Replay(run_id)
        broken: list[tuple[int, bool]] = []
        replay.advance(capture, lambda step, ledger: broken.append((step, ledger.is_broken())))
    finally:
        capture.close()
    expected, expected_broken = one_at_a_time(rows)
    assert broken == expected_broken
    assert state(replay.ledger) == state(expected)
