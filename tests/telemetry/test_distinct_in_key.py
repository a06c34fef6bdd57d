"""store.distinct_in_key (the distinct values of a key column, hopped through its index) gives
what SELECT DISTINCT gives, on SQLite and on PostgreSQL: the snapshot steps of each run (the
Tree page's picker) and the runs that hold event strings (checked at every open)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, insert, select

from kvscope.telemetry import schema
from kvscope.telemetry.store import distinct_in_key

SNAPSHOT_STEPS = {1: [0, 7, 8, 1000, 1001], 2: [], 3: [5], 9: [2, 40]}  # run 2 has none


def fill(engine: Engine) -> None:
    schema.metadata.create_all(engine, tables=[schema.tree_snapshots, schema.event_strings])
    rows = [
        {
            "run_id": run,
            "step": step,
            "node_id": node,
            "num_tokens": 1,
            "token_preview": "",
            "lock_ref": 0,
            "last_access_time": 0.0,
            "hit_count": 0,
            "tombstone": False,
            "depth_tokens": 1,
        }
        for run, steps in SNAPSHOT_STEPS.items()
        for step in steps
        for node in range(3)  # several rows per step: DISTINCT must fold them
    ]
    strings = [{"run_id": run, "code": code, "text": f"s{code}"} for run in (4, 1, 9) for code in range(4)]
    with engine.begin() as conn:
        conn.execute(insert(schema.tree_snapshots), rows)
        conn.execute(insert(schema.event_strings), strings)


def check(engine: Engine) -> None:
    fill(engine)
    t, s = schema.tree_snapshots.c, schema.event_strings.c
    with engine.connect() as conn:
        for run in [*SNAPSHOT_STEPS, 5]:
            hopped = [int(v) for (v,) in conn.execute(distinct_in_key(t.step, t.run_id == run))]
            plain = [int(v) for (v,) in conn.execute(select(t.step).where(t.run_id == run).distinct().order_by(t.step))]
            assert hopped == plain == SNAPSHOT_STEPS.get(run, []), run
        runs = [int(v) for (v,) in conn.execute(distinct_in_key(s.run_id))]
        assert runs == [1, 4, 9]


def test_sqlite(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    try:
        check(engine)
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgresql(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    try:
        check(engine)
    finally:
        engine.dispose()
