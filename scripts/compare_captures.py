"""Compare what two kvscope captures recorded, leaving out what no two runs can share.

    python scripts/compare_captures.py A.db B.db [--run-id N] [--strict-columns]

A restructuring must leave behaviour identical: `make samples` run on the new code has to
record the same event stream as the committed sample captures. This script checks that.
The tables are read with read-only `sqlite3`; the events through kvscope.telemetry's reads
(event_source.read_events), because a capture of schema 6 on keeps them packed in chunks and
its row-layout `events` table is empty: a plain SELECT of it would compare nothing.

NOTE: what is compared, table by table (rows paired by key, in key order)
    events          every column, by (run_id, seq)              except t_mono
                    (read_events: packed chunks or rows, whichever the run has; every run of
                    either side, or --run-id's)
    usage           every column, by (run_id, step)             except t_mono
    leak_checks     every column, by (run_id, step, pool)       except t_mono
    requests        every column, by (run_id, rid)              except arrive_t .. retract_t
    tree_snapshots  every column, by (run_id, step, node_id)    last_access_time as its rank
    reports         kind, through_seq, producer, body (JSON)    except built_at; body less "capture"
    runs            label, status, level, error, config (JSON)  config less "environment", "clock"
NOTE: why those are left out
    - t_mono and the requests' *_t columns read time.monotonic(): they differ on every run.
    - last_access_time is time.monotonic() in the radix cache (a logical counter in the SWA
      cache). Only its order matters to the cache (LRU eviction compares it), so it is compared
      as its dense rank among the nodes of the same snapshot (run_id, step).
    - runs: the started/ended/heartbeat times, host and pid describe the process; the config's
      "environment" holds the host, platform and package versions; its "clock" the monotonic and
      wall clock readings at the start. kvscope_meta (the schema
      version) is not compared: it names the format, not what was recorded.
    - reports: built_at is the wall clock; the body's "capture" is the path the file was written to.
    - Everything else is compared as stored: steps, seq, node ids (numbered in creation order
      from the first node of the process), slot lists, previews, counters. Two runs of
      `make samples` agree on all of it.
    - A column (or JSON key) that only one side has is named in the output and, unless
      --strict-columns, not compared: a new column is an addition, not a changed behaviour.
Exit status: 0 every table equal, 1 some table differs, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from kvscope.telemetry.event_source import EVENT_COLUMNS, read_events
from kvscope.telemetry.queries import Capture as EventCapture
from kvscope.telemetry.store import CaptureError

REQUEST_MOMENTS = ("arrive", "admit", "first_token", "finish", "retract")
REQUIRED_TABLES = ("kvscope_meta", "runs", "events", "usage", "tree_snapshots", "leak_checks", "requests")
MAX_SHOWN_CHARS = 160


class TableSpec(NamedTuple):
    name: str
    run_column: str
    key_columns: tuple[str, ...]  # pairs rows and orders them
    time_columns: tuple[str, ...] = ()  # clock readings: never compared
    rank_columns: tuple[str, ...] = ()  # clock readings compared by their rank among rows sharing key[:-1]
    json_columns: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (JSON text column, top-level keys dropped)
    skip_columns: tuple[str, ...] = ()  # identify the process, not the behaviour
    through_reads: bool = False  # rows from kvscope.telemetry's reads (packed events), not a SELECT

    def dropped_keys(self, column: str) -> tuple[str, ...]:
        return dict(self.json_columns)[column]


TABLES = (
    TableSpec("events", "run_id", ("run_id", "seq"), time_columns=("t_mono",), through_reads=True),
    TableSpec("usage", "run_id", ("run_id", "step"), time_columns=("t_mono",)),
    TableSpec("leak_checks", "run_id", ("run_id", "step", "pool"), time_columns=("t_mono",)),
    TableSpec("requests", "run_id", ("run_id", "rid"), time_columns=tuple(f"{m}_t" for m in REQUEST_MOMENTS)),
    TableSpec("tree_snapshots", "run_id", ("run_id", "step", "node_id"), rank_columns=("last_access_time",)),
    TableSpec(
        "reports", "run_id", ("run_id", "kind"), time_columns=("built_at",), json_columns=(("body", ("capture",)),)
    ),
    TableSpec(
        "runs",
        "id",
        ("id",),
        time_columns=("started_at", "ended_at", "heartbeat_at"),
        json_columns=(("config", ("environment", "clock")),),
        skip_columns=("host", "pid"),
    ),
)


class BadInput(Exception):
    """The arguments do not name two readable kvscope captures."""


class Capture(NamedTuple):
    label: str  # "A" or "B"
    path: Path
    conn: sqlite3.Connection
    tables: frozenset[str]

    def columns(self, table: str) -> list[str]:
        if table == "events":
            return ["run_id", *EVENT_COLUMNS]  # NOTE: what read_events returns from either layout
        return [row[1] for row in self.conn.execute(f'PRAGMA table_info("{table}")')]


class TableResult(NamedTuple):
    line: str
    equal: bool


def open_capture(label: str, path: Path) -> Capture:
    if not path.exists():
        raise BadInput(f"{label}: {path}: no such file")
    if not path.is_file():
        raise BadInput(f"{label}: {path}: not a file")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        names = frozenset(row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    except sqlite3.Error as error:
        raise BadInput(f"{label}: {path}: not an SQLite database ({error})") from None
    missing = [t for t in REQUIRED_TABLES if t not in names]
    if missing:
        raise BadInput(f"{label}: {path}: not a kvscope capture (no table {', '.join(missing)})")
    return Capture(label, path, conn, names)


def drop_json_keys(text: str | None, dropped: tuple[str, ...]) -> Any:
    """The JSON document less its `dropped` top-level keys (text that is no JSON object stays as it is)."""
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    if not isinstance(doc, dict):
        return doc
    return {k: v for k, v in doc.items() if k not in dropped}


def select_sql(spec: TableSpec, columns: list[str], run_id: int | None) -> tuple[str, tuple[int, ...]]:
    selected = []
    for column in columns:
        if column in spec.rank_columns:
            group = ", ".join(f'"{k}"' for k in spec.key_columns[:-1])
            selected.append(f'DENSE_RANK() OVER (PARTITION BY {group} ORDER BY "{column}")')
        else:
            selected.append(f'"{column}"')
    where, params = ("", ()) if run_id is None else (f' WHERE "{spec.run_column}" = ?', (run_id,))
    order = ", ".join(f'"{k}"' for k in spec.key_columns)
    return f'SELECT {", ".join(selected)} FROM "{spec.name}"{where} ORDER BY {order}', params


def plain(value: Any) -> Any:
    """A value read through pandas as the sqlite3 module returns it: None for NULL (NaN), ints
    and floats as Python numbers."""
    if value is None or (isinstance(value, float) and value != value):  # NOTE: NaN != NaN
        return None
    return value.item() if hasattr(value, "item") and not isinstance(value, bytes) else value


def read_event_rows(side: Capture, columns: list[str], run_id: int | None) -> Iterator[tuple[Any, ...]]:
    """Every event of the run (or of each run, in id order) as a row of `columns` (run_id first)."""
    every_run = [row[0] for row in side.conn.execute("SELECT id FROM runs ORDER BY id")]
    run_ids = every_run if run_id is None else [run_id]
    wanted = [c for c in columns if c != "run_id"]
    capture = EventCapture(side.path)
    try:
        for rid in run_ids:
            frame = read_events(capture, rid, wanted)
            for values in zip(*(frame[c].tolist() for c in wanted), strict=True):
                row = dict(zip(wanted, values, strict=True))
                yield tuple(rid if c == "run_id" else plain(row[c]) for c in columns)
    finally:
        capture.close()


def keyed_rows(
    side: Capture, spec: TableSpec, columns: list[str], run_id: int | None
) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
    num_keys = len(spec.key_columns)
    if spec.through_reads:
        for event in read_event_rows(side, columns, run_id):
            yield tuple(event[:num_keys]), event
        return
    json_at = {i: c for i, c in enumerate(columns) if c in dict(spec.json_columns)}
    for row in side.conn.execute(*select_sql(spec, columns, run_id)):
        values = list(row)
        for i, column in json_at.items():
            values[i] = drop_json_keys(values[i], spec.dropped_keys(column))
        yield tuple(values[:num_keys]), tuple(values)


class RowPair(NamedTuple):
    """Two rows with the same key, or one row and None where the other side lacks the key."""

    a_row: tuple[Any, ...] | None
    b_row: tuple[Any, ...] | None

    def compared(self, strict_columns: bool) -> tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]:
        """The rows as compared: unless strict, a JSON object keeps only the keys both sides have."""
        if strict_columns or self.a_row is None or self.b_row is None:
            return self.a_row, self.b_row
        a_values, b_values = list(self.a_row), list(self.b_row)
        for i, (a_value, b_value) in enumerate(zip(self.a_row, self.b_row, strict=True)):
            if isinstance(a_value, dict) and isinstance(b_value, dict):
                a_values[i] = {k: v for k, v in a_value.items() if k in b_value}
                b_values[i] = {k: v for k, v in b_value.items() if k in a_value}
        return tuple(a_values), tuple(b_values)

    def one_sided_keys(self, columns: list[str]) -> Iterator[tuple[str, str, str]]:
        """(column, side, key) for each JSON key only one side of the pair has."""
        if self.a_row is None or self.b_row is None:
            return
        for column, a_value, b_value in zip(columns, self.a_row, self.b_row, strict=True):
            if isinstance(a_value, dict) and isinstance(b_value, dict):
                yield from ((column, "A", k) for k in a_value.keys() - b_value.keys())
                yield from ((column, "B", k) for k in b_value.keys() - a_value.keys())


def merged(
    a_rows: Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]],
    b_rows: Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]],
) -> Iterator[RowPair]:
    """Pairs of rows with the same key; None on the side that lacks the key. Both inputs are in key order."""
    a_next, b_next = next(a_rows, None), next(b_rows, None)
    while a_next is not None or b_next is not None:
        if b_next is None or (a_next is not None and a_next[0] < b_next[0]):
            assert a_next is not None
            yield RowPair(a_next[1], None)
            a_next = next(a_rows, None)
        elif a_next is None or b_next[0] < a_next[0]:
            yield RowPair(None, b_next[1])
            b_next = next(b_rows, None)
        else:
            yield RowPair(a_next[1], b_next[1])
            a_next, b_next = next(a_rows, None), next(b_rows, None)


def shown(spec: TableSpec, columns: list[str], row: tuple[Any, ...] | None, other: tuple[Any, ...] | None) -> str:
    """The row for a reader; a JSON document shows only its keys whose values differ from `other`'s."""
    if row is None:
        return "(no such row)"
    parts = []
    for i, (column, value) in enumerate(zip(columns, row, strict=True)):
        if isinstance(value, bytes):
            text = f"<{len(value)} bytes {value[:16].hex()}{'…' if len(value) > 16 else ''}>"
        elif isinstance(value, dict):
            other_doc = other[i] if other is not None and isinstance(other[i], dict) else {}
            differing = {k: v for k, v in value.items() if k not in other_doc or other_doc[k] != v}
            text = json.dumps(differing, sort_keys=True)
        else:
            text = repr(value)
        if len(text) > MAX_SHOWN_CHARS:
            text = text[:MAX_SHOWN_CHARS] + "…"
        parts.append(f"{column}{' (rank)' if column in spec.rank_columns else ''}={text}")
    return "(" + ", ".join(parts) + ")"


def rows_text(num_rows: int) -> str:
    return f"{num_rows} row{'' if num_rows == 1 else 's'}"


def compare_table(a: Capture, b: Capture, spec: TableSpec, run_id: int | None, strict_columns: bool) -> TableResult:
    present = (spec.name in a.tables, spec.name in b.tables)
    if present == (False, False):
        return TableResult(f"{spec.name}: absent on both sides", True)
    if present != (True, True):
        return TableResult(f"{spec.name}: table only in {'A' if present[0] else 'B'}", False)
    a_columns, b_columns = a.columns(spec.name), b.columns(spec.name)
    left_out = set(spec.time_columns) | set(spec.skip_columns)
    only_a = [c for c in a_columns if c not in b_columns]
    only_b = [c for c in b_columns if c not in a_columns]
    columns = [c for c in a_columns if c in b_columns and c not in left_out]
    columns = list(spec.key_columns) + [c for c in columns if c not in spec.key_columns]
    num_rows, num_differ, first = 0, 0, ""
    json_one_sided: set[tuple[str, str, str]] = set()
    for pair in merged(keyed_rows(a, spec, columns, run_id), keyed_rows(b, spec, columns, run_id)):
        num_rows += 1
        json_one_sided.update(pair.one_sided_keys(columns))
        a_row, b_row = pair.compared(strict_columns)
        if a_row != b_row:
            num_differ += 1
            if not first:
                first = f"; first: A={shown(spec, columns, a_row, b_row)} B={shown(spec, columns, b_row, a_row)}"
    one_sided = [f"column only in A: {', '.join(only_a)}"] * bool(only_a)
    one_sided += [f"column only in B: {', '.join(only_b)}"] * bool(only_b)
    for column, side in sorted({(c, side) for c, side, _ in json_one_sided}):
        keys = sorted(k for c, s, k in json_one_sided if (c, s) == (column, side))
        one_sided.append(f"{column} key only in {side}: {', '.join(keys)}")
    one_sided_differ = strict_columns and bool(one_sided)
    note = ""
    if one_sided:
        note = f" [{'; '.join(one_sided)}{'' if strict_columns else ' (not compared)'}]"
    if num_differ:
        return TableResult(f"{spec.name}: {num_differ} of {rows_text(num_rows)} differ{note}{first}", False)
    if one_sided_differ:
        return TableResult(f"{spec.name}: rows equal ({rows_text(num_rows)}) but the columns differ{note}", False)
    return TableResult(f"{spec.name}: equal ({rows_text(num_rows)}){note}", True)


def check_run(side: Capture, run_id: int) -> None:
    if side.conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
        raise BadInput(f"{side.label}: {side.path}: no run {run_id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("a", type=Path, help="the reference capture (A)")
    parser.add_argument("b", type=Path, help="the capture to check (B)")
    parser.add_argument("--run-id", type=int, default=None, help="compare this run only (default: every run)")
    parser.add_argument(
        "--strict-columns",
        action="store_true",
        help="count a column or JSON key that only one side has as a difference",
    )
    args = parser.parse_args(argv)
    try:
        a, b = open_capture("A", args.a), open_capture("B", args.b)
        if args.run_id is not None:
            check_run(a, args.run_id)
            check_run(b, args.run_id)
        results = [compare_table(a, b, spec, args.run_id, args.strict_columns) for spec in TABLES]
    except BadInput as error:
        print(f"compare_captures: {error}", file=sys.stderr)
        return 2
    except (sqlite3.Error, CaptureError) as error:
        print(f"compare_captures: cannot read the captures: {error}", file=sys.stderr)
        return 2
    for result in results:
        print(result.line)
    return 0 if all(r.equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
