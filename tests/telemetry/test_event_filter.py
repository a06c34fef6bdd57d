"""One EventFilter carries an event read's filters through both layouts: the same filter reads
the same events from a packed run and from its row-layout copy, and a page that is not a count
(a negative offset or limit) is refused in one line instead of slicing from the end."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvscope.telemetry import EventKind
from kvscope.telemetry.event_source import EventFilter, read_events
from kvscope.telemetry.queries import Capture
from tests.telemetry import oracle_reads

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["seq", "step", "kind", "rid", "node_id", "num_tokens", "slots"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Capture]:
    folder = tmp_path_factory.mktemp("layouts")
    packed, rows = folder / "packed.db", folder / "rows.db"
    shutil.copy(ROOT / "sample_runs" / "leaky.db", packed)
    shutil.copy(packed, rows)
    oracle_reads.unpack_to_rows(rows)
    return {"packed": Capture(packed), "rows": Capture(rows)}


def filters(capture: Capture) -> list[EventFilter]:
    frame = capture.events(1, limit=None, columns=["seq", "step", "rid", "node_id"])
    rids = sorted(str(r) for r in frame.rid.dropna().unique())
    node = int(frame.node_id.dropna().iloc[len(frame.node_id.dropna()) // 2])
    mid = int(frame.step.median())
    return [
        EventFilter.of(kinds=[EventKind.ALLOC, EventKind.FREE], step_range=(mid - 3, mid + 3)),
        EventFilter.of(rid=rids[1], rids=rids[:1]),  # one rid replaces rids
        EventFilter.of(rids=rids[2:5], after_seq=int(frame.seq.median())),
        EventFilter.of(node_id=node),
        EventFilter.of(seqs=[7, 3, 3, len(frame) - 1, 10**9]),
        EventFilter.of(kinds=["insert", "evict"], limit=5, offset=4),
        EventFilter(limit=0),
    ]


def test_one_filter_reads_the_same_events_from_either_layout(layouts: dict[str, Capture]) -> None:
    for where in filters(layouts["rows"]):
        packed = read_events(layouts["packed"], 1, COLUMNS, where)
        rows = read_events(layouts["rows"], 1, COLUMNS, where)
        assert len(packed) == len(rows), where
        pd.testing.assert_frame_equal(packed.reset_index(drop=True), rows.reset_index(drop=True), check_dtype=False)
        assert where.limit == 0 or len(packed), f"{where} kept nothing; the comparison would prove little"


def test_the_capture_read_builds_the_same_filter(layouts: dict[str, Capture]) -> None:
    capture = layouts["packed"]
    by_keywords = capture.events(1, kinds=[EventKind.INSERT], limit=7, offset=2, columns=COLUMNS)
    by_filter = read_events(capture, 1, COLUMNS, EventFilter.of(kinds=["insert"], limit=7, offset=2))
    pd.testing.assert_frame_equal(by_keywords, by_filter)


@pytest.mark.parametrize("page", [{"offset": -1}, {"limit": -2}])
def test_a_negative_page_is_refused(layouts: dict[str, Capture], page: dict[str, int]) -> None:
    for capture in layouts.values():
        with pytest.raises(ValueError, match="offset and limit are counts"):
            capture.events(1, **page)  # type: ignore[arg-type]
