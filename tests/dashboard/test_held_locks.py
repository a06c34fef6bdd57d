"""held_locks (vectorized) against the plain stack replay it replaced, on random lock streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.dashboard import reads
from kvscope.dashboard.leak_views import held_locks, lock_holder
from kvscope.telemetry import Capture, EventKind, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard.test_times_and_widths import LEAKY


def reference_held_locks(locks: pd.DataFrame, step: int) -> pd.DataFrame:
    """One stack per (node, holder): an unlock releases the latest lock of the same holder on the
    same node, an unlock with none held releases nothing."""
    held: list[tuple[int, Any, int]] = []
    for row in locks[locks["step"] <= step].sort_values("seq").itertuples():
        if pd.isna(row.node_id):
            continue
        node, holder = int(row.node_id), lock_holder(row)
        if row.kind == "lock":
            held.append((node, holder, int(row.step)))
            continue
        for i in range(len(held) - 1, -1, -1):
            if held[i][0] == node and (held[i][1] == holder or (pd.isna(holder) and pd.isna(held[i][1]))):
                del held[i]
                break
    return pd.DataFrame(held, columns=["node_id", "rid", "since_step"])


EVENT = st.tuples(
    st.sampled_from(["lock", "unlock"]),
    st.sampled_from([1, 2, 3, None]),
    st.sampled_from(["a", "b", None]),
    st.sampled_from([None, "write", "load"]),
    st.integers(0, 2),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENT, max_size=40), st.integers(0, 45))
def test_held_locks_equal_the_stack_replay(events: list[tuple[Any, ...]], step: int) -> None:
    locks = pd.DataFrame(
        [
            {
                "seq": seq,
                "step": seq,
                "kind": kind,
                "rid": rid,
                "node_id": node,
                "num_tokens": 0,
                "aux": aux,
                "reason": reason if rid is None else None,
            }
            for seq, (kind, node, rid, reason, aux) in enumerate(events)
        ],
        columns=["seq", "step", "kind", "rid", "node_id", "num_tokens", "aux", "reason"],
    )
    got, want = held_locks(locks, step), reference_held_locks(locks, step)
    assert got["node_id"].astype(int).tolist() == want["node_id"].astype(int).tolist()
    assert got["since_step"].astype(int).tolist() == want["since_step"].astype(int).tolist()
    assert [None if pd.isna(r) else r for r in got["rid"]] == [None if pd.isna(r) else r for r in want["rid"]]


@settings(max_examples=100, deadline=None)
@given(st.lists(EVENT, max_size=40), st.integers(0, 45))
def test_held_locks_of_rid_codes_name_the_same_holders(events: list[tuple[Any, ...]], step: int) -> None:
    """Rids read as codes (-1 for NULL), decoded only for the locks found held: the same locks."""
    names = {"a": 0, "b": 1}
    rows = [
        {
            "seq": seq,
            "step": seq,
            "kind": kind,
            "node_id": node,
            "num_tokens": 0,
            "aux": aux,
            "reason": reason if rid is None else None,
            "rid": rid,
        }
        for seq, (kind, node, rid, reason, aux) in enumerate(events)
    ]
    columns = ["seq", "step", "kind", "rid", "node_id", "num_tokens", "aux", "reason"]
    as_strings = pd.DataFrame(rows, columns=columns)
    as_codes = as_strings.assign(rid=[names.get(r, -1) if r is not None else -1 for r in as_strings["rid"]])
    texts = np.array(["a", "b"], dtype=object)
    got = held_locks(as_codes, step, lambda codes: np.where(codes >= 0, texts[np.maximum(codes, 0)], None))
    want = held_locks(as_strings, step)
    assert got["node_id"].astype(int).tolist() == want["node_id"].astype(int).tolist()
    assert [None if pd.isna(r) else r for r in got["rid"]] == [None if pd.isna(r) else r for r in want["rid"]]


def test_has_lock_events_agrees_with_a_search_of_the_events(tmp_path: Path) -> None:
    """The Radix tree page asks whether a run recorded any lock from its events per kind (one folded
    row): the same answer as searching its events, on a level-full sample and on a summary capture."""
    summary = tmp_path / "summary.db"
    with SQLRecorder(summary, level="summary", label="summary") as recorder:
        recorder.step = 1
        recorder.usage(UsageSample(1, PoolTerms(100, 60, 30, 10), None, 4, 2, 2, 1, 10, 5, 1, 1, 0, 0))
    for db, expected in ((LEAKY, True), (summary, False)):
        capture = Capture(db)
        try:
            searched = capture.events(1, kinds=[EventKind.LOCK, EventKind.UNLOCK], limit=1, columns=["seq"])
        finally:
            capture.close()
        assert (not searched.empty) is expected, f"{db.name}: the sample is not what the test needs"
        assert reads.has_lock_events(str(db), 1, 0.0) is expected, db.name
