"""The writer's retention pass may drop chunks a replay has listed and not read yet (the checkpointer
reads while the writer drops). Such a read goes on from the ledger checkpoint and ends where a replay
straight through ends; a chunk gone with no drop behind it is still a damaged capture. The checkpointer
stores its state on the way through a long replay."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvscope.debug import checkpoint, ledger_state
from kvscope.debug.ledger import APPLY_COLUMNS, Ledger
from kvscope.debug.replay import KIND_OF, Replay
from kvscope.debug.report import ReportState
from kvscope.telemetry import Capture, CaptureError, EventKind, PoolName, Retention, SQLRecorder, open_writer
from kvscope.telemetry.recorder import _retention_statements
from kvscope.telemetry.retention import ChunkMark, RetentionPass
from kvscope.telemetry.store import save_ledger_checkpoint
from kvscope.telemetry.writer import SQLiteSink

NUM_STEPS = 12
COVERED_CHUNKS = 6  # NOTE: the checkpoint covers chunks 0 .. COVERED_CHUNKS - 1; the drop takes them all


def record(path: Path) -> int:
    """One chunk per step: each step takes 4 blocks and frees the previous step's."""
    recorder = SQLRecorder(path, retention=Retention(keep_events_s=1e9, gated=True))
    for step in range(NUM_STEPS):
        recorder.step = step
        for j in range(4):
            if step:
                recorder.record(EventKind.FREE, pool=PoolName.FULL, rid=f"r{step - 1}-{j}", slots=block(step - 1, j))
            recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step}-{j}", slots=block(step, j))
        recorder.flush()
    recorder.close()
    return int(recorder.run_id)


def block(step: int, j: int) -> np.ndarray:
    return np.arange(8) + 8 * (4 * (step % 2) + j)


def rows_and_chunks(path: Path, run_id: int) -> tuple[list[tuple], list[Any]]:
    capture = Capture(path)
    try:
        rows = [row for batch in capture.event_stream(run_id, APPLY_COLUMNS) for row in batch]
        chunks = list(capture.packed.chunks(run_id).itertuples(index=False))
    finally:
        capture.close()
    return rows, chunks


def one_at_a_time(rows: list[tuple]) -> Ledger:
    ledger = Ledger()
    for kind, step, seq, pool, rid, node_id, num_tokens, aux, blob, reason in rows:
        slots = np.empty(0, np.int64) if blob is None else np.frombuffer(blob, "<i4").astype(np.int64)
        ledger.apply(KIND_OF[kind], step, seq, pool, rid, node_id, num_tokens, aux, slots, reason)
    return ledger


def store_checkpoint(path: Path, run_id: int, rows: list[tuple], through_seq: int) -> None:
    ledger = one_at_a_time([row for row in rows if row[2] <= through_seq])
    engine = open_writer(path)
    try:
        body = ledger_state.encode(ledger, {"current": None, "onset": None})
        save_ledger_checkpoint(engine, run_id, through_seq, -1, ledger_state.FORMAT, body)
    finally:
        engine.dispose()


def drop_as_the_writer_does(path: Path, run_id: int, chunks: list[Any], count: int) -> None:
    """The writer's own retention pass and statements drop the `count` oldest chunks."""
    engine = open_writer(path)
    try:
        statements = _retention_statements(engine)
    finally:
        engine.dispose()
    retention = RetentionPass(run_id, Retention(keep_events_s=1e9, gated=True), statements)
    retention.wrote(
        [ChunkMark(int(c.chunk), int(c.first_seq), int(c.num_events), int(c.first_step), 0.0, 1) for c in chunks]
    )
    sink = SQLiteSink(str(path))
    try:
        retention._drop(sink, count)
    finally:
        sink.close()


def test_a_drop_while_the_replay_reads_goes_on_from_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    run_id = record(path)
    rows, chunks = rows_and_chunks(path, run_id)
    assert len(chunks) == NUM_STEPS
    through = int(chunks[COVERED_CHUNKS - 1].first_seq + chunks[COVERED_CHUNKS - 1].num_events - 1)
    store_checkpoint(path, run_id, rows, through)
    replay, dropped = Replay(run_id), []

    def drop_after_the_first_chunk(_done: int) -> None:
        if not dropped:
            dropped.append(True)
            drop_as_the_writer_does(path, run_id, chunks, COVERED_CHUNKS)

    capture = Capture(path)
    try:
        replay.advance(capture, on_progress=drop_after_the_first_chunk)
    finally:
        capture.close()
    assert dropped and replay.resumed_from == through
    straight = one_at_a_time(rows)
    assert replay.ledger.last_seq == straight.last_seq == len(rows) - 1
    for pool, table in straight.pools.items():
        assert np.array_equal(replay.ledger.pools[pool].kind[: len(table.kind)], table.kind), pool
    held = [{r: n for r, n in t.items() if n} for t in replay.ledger.owners.held.values()]
    assert held == [{r: n for r, n in t.items() if n} for t in straight.owners.held.values()]


def test_a_chunk_gone_without_a_drop_is_still_a_damaged_capture(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    run_id = record(path)
    _rows, chunks = rows_and_chunks(path, run_id)
    gone = int(chunks[3].chunk)

    def lose_a_chunk(_done: int) -> None:
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("DELETE FROM event_columns WHERE run_id = ? AND chunk = ?", (run_id, gone))
        conn.close()

    capture = Capture(path)
    try:
        with pytest.raises(CaptureError, match="damaged capture"):
            Replay(run_id).advance(capture, on_progress=lose_a_chunk)
    finally:
        capture.close()


def test_the_checkpointer_stores_checkpoints_while_it_catches_up(tmp_path: Path, monkeypatch: Any) -> None:
    """A first round over a long run stores its state on the way (here after every chunk), not only
    at its end: the writer may drop what it covers while the round goes on."""
    path = tmp_path / "c.db"
    run_id = record(path)
    stored: list[int] = []

    def store(engine: Any, run: int, through_seq: int, *rest: Any) -> None:
        stored.append(through_seq)
        save_ledger_checkpoint(engine, run, through_seq, *rest)

    monkeypatch.setattr(checkpoint, "SAVE_EVERY_S", 0.0)
    monkeypatch.setattr(checkpoint, "save_ledger_checkpoint", store)
    followed = checkpoint.Followed(ReportState(Replay(run_id)))
    capture, engine = Capture(path), open_writer(path)
    try:
        followed.round(capture, engine)
        found = capture.ledger_checkpoint(run_id)
    finally:
        capture.close()
        engine.dispose()
    assert len(stored) == NUM_STEPS and stored == sorted(stored)
    assert int(found.through_seq) == stored[-1] == followed.saved_seq
