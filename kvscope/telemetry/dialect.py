"""Reading a table through a named index: `FROM events INDEXED BY ix_events_node` on SQLite,
plain `FROM events` on any other database, from the same Core statement.

NOTE: why hints at all. SQLite's planner picks ix_events_kind for `kind = ... AND node_id IN
(...)` and then scans every event of that kind; the derived reads name the index that keeps
each read bounded by the page shown (derived.py, cost). A server database plans these itself,
so the hint exists on SQLite alone and no query is written twice.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, Index, Table, inspect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import TableClause, column


class IndexedTable(TableClause):
    """`table`'s columns, read through `index_name` where the dialect takes a hint (SQLite)."""

    # NOTE: the index name changes the SQL, and the inherited cache key does not carry it:
    # statements using this are compiled each time (a handful per dashboard page)
    inherit_cache = False

    def __init__(self, table: Table, index_name: str) -> None:
        super().__init__(table.name, *(column(c.name, c.type) for c in table.columns))
        self.index_name = index_name


@compiles(IndexedTable)
def _plain(element: IndexedTable, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.visit_table(element, **kw)


@compiles(IndexedTable, "sqlite")
def _sqlite_hint(element: IndexedTable, compiler: SQLCompiler, **kw: Any) -> str:
    plain = compiler.visit_table(element, **kw)
    if not kw.get("asfrom"):
        return plain
    return f"{plain} INDEXED BY {compiler.preparer.quote(element.index_name)}"


def read_through(engine: Engine, index: Index) -> TableClause:
    """The index's table read through it, or the plain table where there is nothing to hint:
    another dialect, or an index not built yet (the deferred ones of a run that never closed)."""
    table = index.table
    assert isinstance(table, Table), index
    if engine.dialect.name != "sqlite" or index.name is None:
        return table
    if index.name not in {ix["name"] for ix in inspect(engine).get_indexes(table.name)}:
        return table
    return IndexedTable(table, str(index.name))
