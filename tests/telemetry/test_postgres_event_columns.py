"""A run's packed event columns and chunk carries read back from PostgreSQL in the server's binary format
(against a real server: `make test-postgres`): the same values as recorded, and no bytea sent as hex text."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvscope.telemetry import EventKind, PoolName
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder

pytestmark = pytest.mark.postgres
psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL driver (pip install 'kvscope[postgres]')")
NUM_EVENTS = 2_000


class CursorFormats:
    """The result formats (0 text, 1 binary) of each query's columns, noted as its cursor closes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[bytes, set[int]]] = []
        close = psycopg.Cursor.close

        def noting_close(cursor: Any) -> None:
            result, query = cursor.pgresult, cursor._query
            if result is not None and query is not None:
                self.seen.append((query.query, {result.fformat(i) for i in range(result.nfields)}))
            close(cursor)

        monkeypatch.setattr(psycopg.Cursor, "close", noting_close)

    def formats_of(self, selected: str) -> set[int]:
        """The formats of the columns read by the queries that select `selected` (a table.column)."""
        return {f for query, formats in self.seen if selected.encode() in query for f in formats}


def test_event_columns_come_back_from_the_server_in_binary_format_with_the_values_recorded(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = [np.arange(i % 7 + 1, dtype=np.int64) * 1_000 + i for i in range(NUM_EVENTS)]
    with SQLRecorder(postgres_url, level="full", label="binary") as recorder:
        for i, these in enumerate(slots):
            recorder.step = i // 100
            recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{i}", num_tokens=len(these), slots=these)
            if i % 3 == 0:
                recorder.record(EventKind.LOCK, rid=f"r{i}", node_id=i % 11, num_tokens=1)
    formats = CursorFormats(monkeypatch)
    capture = Capture(postgres_url)
    try:
        read = capture.events(
            recorder.run_id, kinds=[EventKind.ALLOC], limit=None, columns=["step", "rid", "num_tokens", "slots"]
        )
        carried = capture.packed.carried(recorder.run_id, capture.schema_version, "lock_carry")
        computed = [capture.packed.computed_carries(recorder.run_id, c)[1] for c in carried.itertuples(index=False)]
    finally:
        capture.close()
    assert read.step.tolist() == [i // 100 for i in range(NUM_EVENTS)]
    assert read.rid.tolist() == [f"r{i}" for i in range(NUM_EVENTS)]
    assert read.num_tokens.tolist() == [len(s) for s in slots]
    assert [np.frombuffer(b, "<i4").tolist() for b in read.slots] == [s.tolist() for s in slots]
    assert carried.lock_carry.tolist() == computed and all(computed)
    assert formats.formats_of("event_columns.data") == {1}, "event columns read as text: bytea sent as hex digits"
    assert formats.formats_of("event_chunks.lock_carry") == {1}, "carries read as text: bytea sent as hex digits"
