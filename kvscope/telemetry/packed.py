"""Events packed by column: the recorder's buffered events become one chunk of numpy columns
(schema version 6), so a flush writes a handful of blobs instead of one row per event.

NOTE: a chunk
    event_chunks   one row per chunk: first_seq, num_events (its events have seqs first_seq ..
                   first_seq + num_events - 1, in order), first/last step, the distinct kinds
                   (comma-separated, so a read by kind skips the chunks without them)
    event_columns  one row per chunk and column: the column's values as little-endian bytes of
                   `dtype`, the narrowest integer type that holds them (readers widen them to
                   COLUMN_DTYPES; t_mono is always float64); a read of some columns reads only
                   their rows
    event_strings  the run's string dictionary: every kind, pool, rid, reason and principal
                   is an int32 code (NO_CODE: NULL), defined in the transaction of the first
                   chunk that uses it (again, after retention dropped it with the chunks that
                   used it: StringCodes)
    slots          every event's slots, concatenated; `slot_counts` says how many belong to each
                   event (NO_SLOTS: NULL, as an event recorded without slots)
    node_id        NULL is NULL_INT (no recorded node id is that negative); stored narrower, NULL
                   is the narrow type's smallest value (chosen only when no id is that small)

NOTE: what the packer takes: buffered items laid end to end in one flat list, ITEM_WIDTH values
each, in ITEM_FIELDS order (the recorder extends one list per event: no object per event to
allocate or for the garbage collector to track). kind, pool, reason and principal are str or
None; slots is None or the slots' bytes (SLOT_WIRE_DTYPE as the recorder hands them over). A
batch item (record_batch: one kind for several requests at once, their slots concatenated)
carries BATCH in its node_id and tuples of rids and token counts, and unpacks into one event
per request, in order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from itertools import repeat as forever
from operator import is_, is_not
from typing import Any

import numpy as np

from kvscope.telemetry.carry import carries
from kvscope.telemetry.events import EventKind

ITEM_FIELDS = ("step", "t_mono", "kind", "pool", "rid", "node_id", "num_tokens", "aux", "reason", "principal", "slots")
ITEM_WIDTH = len(ITEM_FIELDS)
SLOT_WIRE_DTYPE = "=i8"  # NOTE: slots as the recorder hands them over: int64 arrays' raw bytes
STRING_COLUMNS = ("kind", "pool", "rid", "reason", "principal")
COLUMN_DTYPES = {
    "step": "<i8",
    "t_mono": "<f8",
    "kind": "<i4",
    "pool": "<i4",
    "rid": "<i4",
    "node_id": "<i8",
    "num_tokens": "<i8",
    "aux": "<i8",
    "reason": "<i4",
    "principal": "<i4",
    "slot_counts": "<i4",
    "slots": "<i4",
}
STORED_COLUMNS = tuple(COLUMN_DTYPES)
NO_CODE = -1
NO_SLOTS = -1
NULL_INT = np.iinfo(np.int64).min
NOT_USED, FORGOTTEN = -1, -2  # NOTE: StringCodes.last_chunk of a code no chunk used yet, and of one whose row is gone


BATCH: Any = ...  # NOTE: the node_id of a batch item (Ellipsis: a singleton marshal carries)


class StringCodes(dict[Any, int]):
    """The run's dictionary, string -> code; an unseen string gets the next code (and is kept
    in `new` until the chunk that defines it is written).

    NOTE: retention drops strings with the chunks (telemetry/retention.py): `last_chunk[code]` is
    the last chunk (in pack order) that used a code, and `unused_through(n)` the codes no chunk after
    chunk n uses. Once their rows are deleted (`forgotten`), a code keeps its string here: a later
    chunk that uses it again defines the same code again (`new`), so a code means one string for the
    run's life."""

    def __init__(self) -> None:
        super().__init__({None: NO_CODE})
        self.texts: list[str] = []  # code -> string
        self.new: list[tuple[int, str]] = []
        self.last_chunk = np.full(1024, NOT_USED, np.int64)

    def __missing__(self, key: Any) -> int:
        code = len(self.texts)
        self[key] = code
        self.texts.append(str(key))
        self.new.append((code, str(key)))
        return code

    def decode(self, codes: np.ndarray) -> list[str]:
        texts = self.texts
        return [texts[c] for c in codes.tolist()]

    def encode(self, values: Sequence[Any]) -> np.ndarray:
        # NOTE: pool, reason and principal are mostly NULL; any() stops at the first string
        if not any(values) and values.count(None) == len(values):
            return np.full(len(values), NO_CODE, np.int32)
        return np.fromiter(map(self.__getitem__, values), np.int32, len(values))

    def used_in(self, chunk: int, codes: np.ndarray) -> None:
        """Chunk `chunk` holds `codes`: those forgotten are defined again with it."""
        codes = codes[codes != NO_CODE]
        if not len(codes):
            return
        if len(self.texts) > len(self.last_chunk):
            grown = np.full(2 * len(self.texts), NOT_USED, np.int64)
            grown[: len(self.last_chunk)] = self.last_chunk
            self.last_chunk = grown
        back = codes[self.last_chunk[codes] == FORGOTTEN]
        if len(back):
            self.new += [(code, self.texts[code]) for code in np.unique(back).tolist()]
        self.last_chunk[codes] = chunk

    def unused_through(self, chunk: int) -> np.ndarray:
        """The codes whose rows are written and that no chunk after `chunk` uses."""
        used = self.last_chunk[: len(self.texts)]
        return np.flatnonzero((used >= 0) & (used <= chunk))

    def forget(self, codes: Sequence[int]) -> None:
        """Their rows were deleted (in the transaction that dropped their last chunk)."""
        self.last_chunk[np.asarray(codes, np.int64)] = FORGOTTEN


@dataclass
class Chunk:
    first_seq: int
    num_events: int
    first_step: int
    last_step: int
    kinds: str  # the distinct kinds, sorted, comma-separated
    columns: dict[str, tuple[str, bytes]]  # name -> (stored dtype, data)
    new_strings: list[tuple[int, str]]
    kind_counts: str = "{}"  # {kind: events}, JSON (schema version 10: summaries)
    groups: str = "{}"  # its events grouped for the dashboard's sums, JSON (summaries)
    evict_steps: bytes = b""  # its evictions per step (schema version 11: carry.py)
    lock_carry: bytes = b""  # its net change to the locks held (carry.py)
    request_carry: bytes = b""  # the requests it leaves running or ends (carry.py)
    miss_nodes: bytes = b""  # the nodes its matches missed tokens at (schema version 13: carry.py)

    @property
    def num_bytes(self) -> int:
        """Its columns' packed bytes (schema.event_chunks.num_bytes)."""
        return sum(len(data) for _, data in self.columns.values())

    @property
    def last_t_mono(self) -> float:
        return float(np.frombuffer(self.columns["t_mono"][1], "<f8")[-1]) if self.num_events else 0.0

    def table_rows(self, run_id: int, number: int) -> dict[str, list[tuple[Any, ...]]]:
        """The chunk as rows of the packed tables (schema.PACKED_TABLES' columns, in order), as
        the run's chunk `number`."""
        return {
            "event_strings": [(run_id, code, text) for code, text in self.new_strings],
            "event_chunks": [
                (
                    run_id,
                    number,
                    self.first_seq,
                    self.num_events,
                    self.first_step,
                    self.last_step,
                    self.kinds,
                    self.num_bytes,
                    self.kind_counts,
                    self.groups,
                    self.evict_steps,
                    self.lock_carry,
                    self.request_carry,
                    self.miss_nodes,
                )
            ],
            "event_columns": [(run_id, number, name, dtype, data) for name, (dtype, data) in self.columns.items()],
        }


class Packer:
    """Turns the recorder's buffered items into chunks; owns the run's seq counter and string
    codes (one Packer per run)."""

    def __init__(self) -> None:
        self.codes = StringCodes()
        self.next_seq = 0
        self.num_chunks = 0  # NOTE: chunks packed so far: a chunk's number is its place in pack order

    def pack(self, items: list[Any], *, has_batches: bool = False, slot_dtype: str = SLOT_WIRE_DTYPE) -> Chunk:
        """`items`: flat, ITEM_WIDTH values per item (see the module's note); `has_batches`:
        whether any item is a batch item."""
        w = ITEM_WIDTH
        step, t_mono, kind, pool, rid, node_id, num_tokens, aux, reason, principal, slots = (
            items[i::w] for i in range(w)
        )
        repeat = batches = None
        if has_batches:
            repeat, is_batch, rid, num_tokens, node_id = _expand_batches(node_id, rid, num_tokens)
            batches = (repeat, is_batch)
        codes = self.codes
        columns: dict[str, np.ndarray] = {}
        for name, values in (("kind", kind), ("pool", pool), ("reason", reason), ("principal", principal)):
            columns[name] = _repeated(codes.encode(values), repeat)
        columns["rid"] = codes.encode(rid)
        for name in STRING_COLUMNS:
            codes.used_in(self.num_chunks, columns[name])
        self.num_chunks += 1
        columns["step"] = _repeated(np.fromiter(step, np.int64, len(step)), repeat)
        columns["t_mono"] = _repeated(np.fromiter(t_mono, np.float64, len(t_mono)), repeat)
        columns["node_id"] = _node_ids(node_id)
        columns["num_tokens"] = np.fromiter(num_tokens, np.int64, len(num_tokens))
        columns["aux"] = _repeated(np.fromiter(aux, np.int64, len(aux)), repeat)
        columns["slot_counts"], columns["slots"] = _slots(slots, np.dtype(slot_dtype), batches, columns["num_tokens"])
        n = len(columns["step"])
        first = self.next_seq
        self.next_seq += n
        new, codes.new = codes.new, []
        # NOTE: dict.get: a kind's lookup never adds a code
        kind_counts, groups = summaries(columns, lambda kind: dict.get(codes, kind), codes.decode)
        evict_steps, lock_carry, request_carry, misses = carries(columns, first, lambda text: dict.get(codes, text))
        return Chunk(
            first_seq=first,
            num_events=n,
            first_step=int(columns["step"].min()) if n else 0,
            last_step=int(columns["step"].max()) if n else 0,
            kinds=",".join(sorted(set(kind))),
            columns={name: narrow(name, columns[name]) for name in STORED_COLUMNS},
            new_strings=new,
            kind_counts=kind_counts,
            groups=groups,
            evict_steps=evict_steps,
            lock_carry=lock_carry,
            request_carry=request_carry,
            miss_nodes=misses,
        )


SUMMARY_FIELDS = ("kind", "pool", "reason", "principal", "step", "num_tokens", "aux")  # NOTE: what summaries read
REUSE_KINDS = (EventKind.MATCH.value, EventKind.CROSS_HIT.value)


def summaries(
    columns: Mapping[str, np.ndarray],
    code_of: Callable[[str], int | None],
    decode: Callable[[np.ndarray], Sequence[str]],
) -> tuple[str, str]:
    """A chunk's summaries (schema version 10), as JSON, from its SUMMARY_FIELDS columns (strings as
    codes; `code_of`: a kind's code, None when the run has none; `decode`: codes to their strings).

    NOTE: what they hold (each a sum a read adds up over the chunks; None: NULL)
        kind_counts           {kind: events}
        groups["reuse"]       [principal, kind, tokens] per principal and kind of match and cross_hit events
        groups["evictions"]   [reason, pool, evictions, tokens, first step, last step] per reason and pool
        groups["stops"]       [reason, lookups, hit tokens, missed tokens] per reason of match events that
                              name one"""
    kind = np.asarray(columns["kind"])
    found, counts = np.unique(kind, return_counts=True)
    per_kind = dict(zip(map(str, decode(found)), counts.tolist(), strict=True))
    text = _texts(decode)
    c = columns
    match, evict = _is(kind, [code_of(EventKind.MATCH.value)]), _is(kind, [code_of(EventKind.EVICT.value)])
    reuse = _grouped(_is(kind, [code_of(k) for k in REUSE_KINDS]), [c["principal"], kind], [(c["num_tokens"], "sum")])
    evictions = _grouped(
        evict,
        [c["reason"], c["pool"]],
        [(None, "count"), (c["num_tokens"], "sum"), (c["step"], "min"), (c["step"], "max")],
    )
    named = match & (np.asarray(c["reason"]) != NO_CODE)
    stops = _grouped(named, [c["reason"]], [(None, "count"), (c["num_tokens"], "sum"), (c["aux"], "sum")])
    groups = {
        "reuse": [[text(p), text(k), *rest] for p, k, *rest in reuse],
        "evictions": [[text(r), text(p), *rest] for r, p, *rest in evictions],
        "stops": [[text(r), *rest] for r, *rest in stops],
    }
    return json.dumps(per_kind, sort_keys=True), json.dumps(groups, sort_keys=True)


# NOTE: per group of `summaries`: how many leading values of a row are its key, and how each later value folds
GROUP_FOLDS: dict[str, tuple[int, tuple[str, ...]]] = {
    "reuse": (2, ("sum",)),
    "evictions": (2, ("sum", "sum", "min", "max")),
    "stops": (1, ("sum", "sum", "sum")),
}
_FOLD: dict[str, Callable[[int, int], int]] = {"sum": lambda a, b: a + b, "min": min, "max": max}


class SummaryFold:
    """Chunks' summaries (`summaries`, parsed) folded into one, as a run's whole (schema version 14): events
    per kind added, each group's rows merged by key (counts and sums added, least and greatest kept). Its
    kind_counts and group rows sum (or min and max) to what the chunks' own give; a row's order is not kept.

    NOTE: it folds every chunk numbered up to through_chunk (num_chunks of them, num_events events) and
    cannot take one out again (a least or greatest step is lost in it): retention's drops end it."""

    def __init__(self) -> None:
        self.through_chunk = -1
        self.num_chunks = 0
        self.num_events = 0
        self.kind_counts: dict[str, int] = {}
        self.groups: dict[str, dict[tuple[Any, ...], list[int]]] = {name: {} for name in GROUP_FOLDS}

    def add(self, number: int, num_events: int, kind_counts: Mapping[str, Any], groups: Mapping[str, Any]) -> None:
        """Fold chunk `number` (the next after through_chunk) in: its events and its parsed summaries."""
        self.through_chunk = max(self.through_chunk, number)
        self.num_chunks += 1
        self.num_events += num_events
        for kind, count in kind_counts.items():
            self.kind_counts[kind] = self.kind_counts.get(kind, 0) + int(count)
        for name, (width, folds) in GROUP_FOLDS.items():
            merged = self.groups[name]
            for row in groups.get(name, []):
                key, values = tuple(row[:width]), [int(v) for v in row[width:]]
                found = merged.get(key)
                if found is None:
                    merged[key] = values
                else:
                    merged[key] = [_FOLD[how](a, b) for how, a, b in zip(folds, found, values, strict=True)]

    @property
    def num_rows(self) -> int:
        """Its groups' rows (what storing it writes out)."""
        return sum(len(rows) for rows in self.groups.values())

    def rows(self, name: str) -> list[list[Any]]:
        """One group's rows, one per key, in the shape of a chunk's."""
        return [[*key, *values] for key, values in self.groups[name].items()]

    def row(self, run_id: int) -> tuple[Any, ...]:
        """Its run_summaries row (schema.RUN_SUMMARY_COLUMNS)."""
        groups = {name: self.rows(name) for name in GROUP_FOLDS}
        counts = json.dumps(self.kind_counts, sort_keys=True)
        return (
            run_id,
            self.through_chunk,
            self.num_chunks,
            self.num_events,
            counts,
            json.dumps(groups, sort_keys=True),
        )

    @classmethod
    def of_row(cls, row: Any) -> SummaryFold:
        """A stored run_summaries row's fold (ValueError: not what kvscope writes)."""
        fold = cls()
        counts, groups = json.loads(row.kind_counts), json.loads(row.groups)
        if not isinstance(counts, dict) or not isinstance(groups, dict):
            raise ValueError("not a fold")
        fold.add(int(row.through_chunk), int(row.num_events), counts, groups)
        fold.num_chunks = int(row.num_chunks)
        return fold


def _is(kind: np.ndarray, codes: Sequence[int | None]) -> np.ndarray:
    return np.isin(kind, [code for code in codes if code is not None])


def _texts(decode: Callable[[np.ndarray], Sequence[str]]) -> Callable[[int], str | None]:
    return lambda code: None if code == NO_CODE else str(decode(np.asarray([code], np.int64))[0])


def _grouped(
    mask: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[tuple[np.ndarray | None, str]]
) -> list[list[int]]:
    """Rows of the masked events grouped by one or two `keys` (codes), in key order: the keys, then
    each (column, "count" | "sum" | "min" | "max") of the group, as Python ints.

    NOTE: the keys are one int64 (each code + 1 in 32 bits), and each group's values a run of the events
    sorted by it, reduced at once (np.unique over rows and ufunc.at cost 0.8 µs an event)."""
    if not mask.any():
        return []
    key = np.zeros(int(mask.sum()), np.int64)
    for k in keys:
        key = (key << 32) | (np.asarray(k)[mask].astype(np.int64) + 1)
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    unique = ordered[starts]
    shifts = [32 * (len(keys) - 1 - i) for i in range(len(keys))]
    out = [((unique >> shift) & 0xFFFFFFFF) - 1 for shift in shifts]
    reduce = {"sum": np.add, "min": np.minimum, "max": np.maximum}
    for column, how in values:
        if how == "count":
            out.append(np.diff(np.r_[starts, len(ordered)]))
        else:
            out.append(reduce[how].reduceat(np.asarray(column)[mask].astype(np.int64)[order], starts))
    return [list(row) for row in zip(*(o.tolist() for o in out), strict=True)]


_NARROW_INTS = tuple(np.dtype(t) for t in ("<i1", "<i2", "<i4", "<i8"))


def narrow(name: str, values: np.ndarray) -> tuple[str, bytes]:
    """(stored dtype, little-endian bytes) of a column: integers in the narrowest type that holds
    them (node_id's NULL_INT as that type's smallest value, see the module's note)."""
    if name == "t_mono":
        return "<f8", np.ascontiguousarray(values, "<f8").tobytes()
    if not len(values):
        return "<i1", b""
    if name == "node_id":  # NOTE: the narrow type's smallest value is NULL: no id may be that small
        nulls = values == NULL_INT
        present = values[~nulls]
        low, high = (int(present.min()), int(present.max())) if len(present) else (0, 0)
        for dtype in _NARROW_INTS[:-1]:
            info = np.iinfo(dtype)
            if info.min < low and high <= info.max:
                return dtype.str, np.where(nulls, info.min, values).astype(dtype).tobytes()
        return "<i8", np.ascontiguousarray(values, "<i8").tobytes()
    low, high = int(values.min()), int(values.max())
    for dtype in _NARROW_INTS:
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype.str, values.astype(dtype).tobytes()
    raise ValueError(f"column {name} holds values beyond int64")  # NOTE: unreachable from int64 arrays


_STORED_INTS = frozenset({*(t.str for t in _NARROW_INTS), "<i1"})  # NOTE: "<i1": an empty column (narrow)


def writes_dtype(name: str, stored_dtype: str) -> bool:
    """Whether `narrow` ever stores column `name` as `stored_dtype` (a reader refuses any other)."""
    return stored_dtype == "<f8" if name == "t_mono" else stored_dtype in _STORED_INTS


def widen(name: str, stored_dtype: str, data: bytes) -> np.ndarray:
    """A stored column as COLUMN_DTYPES[name] (narrow's inverse)."""
    return widen_array(name, np.frombuffer(data, stored_dtype))


def widen_array(name: str, values: np.ndarray) -> np.ndarray:
    """Stored values (or a selection of them) as COLUMN_DTYPES[name]: a reader filters a chunk's
    narrow columns first and widens only what it keeps."""
    wanted = np.dtype(COLUMN_DTYPES[name])
    if values.dtype == wanted:
        return values
    wide = values.astype(wanted)
    if name == "node_id":
        wide[values == np.iinfo(values.dtype).min] = NULL_INT
    return wide


def _node_ids(node_id: list[Any]) -> np.ndarray:
    """NULL_INT for None. NOTE: through float64 (None is NaN) when every id is below 2**53, where
    float64 is exact; the slow way otherwise."""
    as_float = np.array(node_id, np.float64)
    nulls = np.isnan(as_float)
    if nulls.all() or np.abs(as_float[~nulls]).max() < _FLOAT_EXACT:
        return np.where(nulls, NULL_INT, as_float).astype(np.int64)
    return np.fromiter([NULL_INT if v is None else v for v in node_id], np.int64, len(node_id))


_FLOAT_EXACT = float(2**53)


def _repeated(values: np.ndarray, repeat: np.ndarray | None) -> np.ndarray:
    return values if repeat is None else np.repeat(values, repeat)


def _expand_batches(
    node_id: list[Any], rid: list[Any], num_tokens: list[Any]
) -> tuple[np.ndarray, np.ndarray, list[Any], list[Any], list[Any]]:
    """Per buffered item, how many events it unpacks into and whether it is a batch item; the
    per-event rid, num_tokens and node_id columns. NOTE: Python work per batch item only; the
    plain items between two batch items are copied as list slices."""
    is_batch = np.fromiter(map(is_, node_id, forever(BATCH)), bool, len(node_id))
    where = np.flatnonzero(is_batch).tolist()
    repeat = np.ones(len(node_id), np.int64)
    rids: list[Any] = []
    tokens: list[Any] = []
    nodes: list[Any] = []
    start = 0
    for i in where:
        rids += rid[start:i]
        tokens += num_tokens[start:i]
        nodes += node_id[start:i]
        batch_rids = rid[i]
        repeat[i] = len(batch_rids)
        rids += batch_rids
        tokens += num_tokens[i]
        nodes += [None] * len(batch_rids)
        start = i + 1
    rids += rid[start:]
    tokens += num_tokens[start:]
    nodes += node_id[start:]
    return repeat, is_batch, rids, tokens, nodes


def _slots(
    slots: list[Any], dtype: np.dtype, batches: tuple[np.ndarray, np.ndarray] | None, num_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(per-event slot counts, every slot concatenated in event order). A batch item's slots
    split by its requests' token counts."""
    present = np.fromiter(map(is_not, slots, forever(None)), bool, len(slots))
    num_present = int(np.count_nonzero(present))
    if num_present == len(slots):
        counts = np.fromiter(map(len, slots), np.int32, len(slots)) // dtype.itemsize
    else:
        counts = np.full(len(slots), NO_SLOTS, np.int32)
        if num_present:
            counts[present] = np.fromiter(map(len, compress(slots, present)), np.int32, num_present) // dtype.itemsize
    if batches is not None:
        repeat, is_batch = batches
        counts = np.repeat(counts, repeat)
        per_event = np.repeat(is_batch, repeat)
        counts[per_event] = num_tokens[per_event]
    if not num_present:
        return counts, np.zeros(0, np.int32)
    data = b"".join(compress(slots, present) if num_present < len(slots) else slots)
    return counts, np.frombuffer(data, dtype).astype(np.int32)
