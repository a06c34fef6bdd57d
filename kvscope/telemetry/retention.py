"""Retention: a run keeps its raw events for a window (`--keep-events 6h`) or under a size
bound (`--max-size 20GiB`), dropping its oldest whole chunks; everything else it records
(requests, leak checks, census blocks, usage, the tree snapshots at its leak checks) it keeps for
its whole life.

NOTE: who drops what, when
    The writer process runs a pass after each commit (RetentionPass.after_write), in its own
    thread between transactions: the engine never waits for it. A pass deletes the oldest chunks
    of its own run (event_columns, then event_chunks) and moves the run's event_retention row in
    the same transaction, so a reader sees either the chunks or the row that says they are gone.
    The tree snapshots of steps before the first kept event's step go with them, but those at a
    leak check's step: a tree at a later step is rebuilt from a snapshot and the events after it,
    and the events after those are gone (a census's snapshot stays, as every leak check does). The
    usage series is downsampled past the same step: one row in USAGE_EVERY_STEPS steps stays, and
    the row at each leak check (its counters are cumulative, so rates over the rows left hold).
    The strings that only the dropped chunks used go in the same transaction (packed.StringCodes
    knows each code's last chunk; a code used again later is written again). It never drops the
    run's newest chunk (a run with events keeps at least one chunk).
NOTE: the size a bound counts
    A SQLite file: the database's pages in use, (page_count - freelist_count) * page_size, over
    every table and run in the file. A freed page is reused by the next writes, so the file's
    size is the high-water mark of pages in use: a pass starts dropping above HIGH_WATER of the
    bound, or when the next batch (as large as the largest of the last RECENT_BATCHES) would not
    fit, and drops to LOW_WATER, or lower to leave room for two such batches (a slow writer's
    batch is up to flush_max_events: several MB). The -wal log is not counted (it is folded in,
    up to a few MB at a time).
    A server database (PostgreSQL): the run's own packed event bytes (the database is shared by
    many engines' runs; its tables' sizes are the server's).
NOTE: the ledger gate
    A run recorded at level `full` by kvscope's engine has its verdict from the slot ledger, which
    needs every event from the run's start. Such a run is `gated`: a pass drops only the chunks a
    stored ledger checkpoint (ledger_checkpoints.through_seq) already covers, so a replay starts
    from that state and its verdict stays exact. A size bound waits for the gate up to HARD_WATER
    less the largest recent batch's bytes, so the next batch still fits (a fast engine's batch is MBs: an
    8 MiB bound was passed by one while the gate held). The checkpointer starts when a quarter of
    the bound is used, and is ahead long before; past that point
    the bound wins, and readers see that the checkpoint stops short of the first kept event (their
    verdict is then inconclusive, never clean).
NOTE: a bound that cannot be kept
    What a run keeps for life is never dropped, so a bound smaller than it (and the newest chunk) is
    passed: the pass then says so once (over_bound_line: the writer prints it on the verb's stderr),
    and readers say it of the capture as it is (over_bound: `kvscope runs`, the dashboard's sidebar).
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from typing import Any, NamedTuple, Protocol

USAGE_EVERY_STEPS = 10  # NOTE: past the kept events, one usage row in this many steps stays (and each at a leak check)
HIGH_WATER = 0.8  # NOTE: a pass drops when the size passes this share of the bound ...
LOW_WATER = 0.6  # ... down to this share (the margin takes a batch and a checkpoint rewritten beside it)
RECENT_BATCHES = 8  # NOTE: the next batch may be as large as the largest of these (its room is kept free)
HARD_WATER = 0.95  # NOTE: a gated run's size drops wait for its ledger checkpoint up to this share
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_UNITS_BYTES = {
    "b": 1,
    **{f"{p}{end}": 2 ** (10 * (k + 1)) for k, p in enumerate("kmgt") for end in ("", "i", "ib")},
    **{f"{p}b": 10 ** (3 * (k + 1)) for k, p in enumerate("kmgt")},
}  # NOTE: as units.BYTE_SCALES spells them (G, Gi, GiB binary; GB decimal), but a unit is required


def parse_duration_s(text: str) -> float:
    """'90s', '30m', '6h', '7d' (or a bare number of seconds) as seconds > 0; ValueError otherwise."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text.lower())
    value = float(found.group(1)) * _UNITS_S[found.group(2) or "s"] if found else math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{text!r} is not a duration (a positive number with s, m, h or d: '6h')")
    return value


def parse_size_bytes(text: str) -> int:
    """'20GiB', '20G', '500MB', '4096B' as bytes > 0; ValueError otherwise. A bare number is refused:
    the command line reads a bare memory size as GiB, an environment variable might mean bytes, and
    the same text must mean one size in `--max-size` and KVSCOPE_MAX_SIZE."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
    scale = _UNITS_BYTES.get(found.group(2)) if found else None
    value = int(float(found.group(1)) * scale) if found and scale else 0
    if value <= 0:
        raise ValueError(
            f"{text!r} is not a size (a positive number with its unit: 4096B, 512MiB or 512M, 20GiB or 20G; "
            "KB, MB, GB are decimal)"
        )
    return value


def size_text(num_bytes: float) -> str:
    """A size for people: '1.2 MiB', '512 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


class OverBound(NamedTuple):
    """A capture past a run's size bound: its bytes in use and, of those, what no pass may drop
    (everything but the kept events: leak checks, censuses, requests, usage, tree snapshots)."""

    used_bytes: int
    max_bytes: int
    kept_for_life_bytes: int

    def text(self) -> str:
        return (
            f"the capture holds {size_text(self.used_bytes)}, over its bound of {size_text(self.max_bytes)}: what "
            f"is kept for life (leak checks, censuses, requests, usage, tree snapshots) takes "
            f"{size_text(self.kept_for_life_bytes)} of it, and none of it is dropped"
        )


def over_bound(max_bytes: int | None, used_bytes: int | None, event_bytes: int) -> OverBound | None:
    """The capture past `max_bytes` (None: within it, or no size bound). `used_bytes`: the size the
    bound counts (module NOTE); `event_bytes`: the kept events' packed bytes within it."""
    if max_bytes is None or used_bytes is None or used_bytes <= max_bytes:
        return None
    return OverBound(used_bytes, max_bytes, max(0, used_bytes - event_bytes))


class Retention(NamedTuple):
    """What a run keeps of its events: the newest `keep_events_s` seconds of them and/or as much
    as fits in `max_bytes` (None: no such bound); `gated`: the run's verdict needs the ledger
    (see the NOTE on the gate)."""

    keep_events_s: float | None = None
    max_bytes: int | None = None
    gated: bool = False

    @property
    def bounded(self) -> bool:
        return self.keep_events_s is not None or self.max_bytes is not None


class Sink(Protocol):
    def write(self, work: list[tuple[Any, list[Any]]]) -> None: ...

    def used_bytes(self) -> int | None: ...

    def scalar(self, statement: Any, row: tuple[Any, ...]) -> Any: ...


class Strings(Protocol):
    """The writer's string dictionary (packed.StringCodes): which codes the dropped chunks alone used."""

    def unused_through(self, chunk: int) -> Any: ...

    def forget(self, codes: Any) -> None: ...


class ChunkMark(NamedTuple):
    """What the pass remembers of a chunk its writer wrote."""

    number: int
    first_seq: int
    num_events: int
    first_step: int
    last_t_mono: float
    num_bytes: int

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.num_events - 1


class RetentionPass:
    """The writer's side: the chunks of its run still kept, and the drops. `statements` are the
    sink's statements (writer.RetentionStatements)."""

    def __init__(self, run_id: int, retention: Retention, statements: Any, strings: Strings | None = None) -> None:
        self.run_id = run_id
        self.strings = strings
        self.retention = retention
        self.statements = statements
        self.kept: deque[ChunkMark] = deque()
        self.kept_bytes = 0
        self.dropped_chunks = 0
        self.dropped_bytes = 0
        self.started = False
        self.thinned_to = 0  # NOTE: usage rows before this step are thinned already
        self.said_over = False  # NOTE: the line that the bound cannot be kept is said once
        self.batches: deque[int] = deque(maxlen=RECENT_BATCHES)

    def first_rows(self) -> list[tuple[Any, list[Any]]]:
        """The run's event_retention row, written with its first batch."""
        if self.started:
            return []
        self.started = True
        r = self.retention
        return [(self.statements.insert, [(self.run_id, r.keep_events_s, r.max_bytes, 0, -1, 0, 0, None)])]

    def wrote(self, marks: list[ChunkMark]) -> None:
        """The chunks of one transaction (a batch can hold several: CHUNK_ITEMS events each)."""
        for mark in marks:
            self.kept.append(mark)
            self.kept_bytes += mark.num_bytes
        self.batches.append(sum(m.num_bytes for m in marks))

    @property
    def batch_bytes(self) -> int:
        """The largest of the recent transactions' event bytes: room the next one may need."""
        return max(self.batches, default=0)

    def after_write(self, sink: Sink) -> str | None:
        """Drop what the bounds no longer keep (see the module NOTE); a failure is the caller's.
        Returns a line, once, when the capture stays past its size bound with nothing left to drop."""
        used = self._used(sink)
        if len(self.kept) < 2:
            return self._over_bound_line(used)
        count = max(self._past_window(), self._over_size(used))
        bound = self.retention.max_bytes
        if count and self.retention.gated and (bound is None or used + self.batch_bytes <= HARD_WATER * bound):
            count = min(count, self._covered(sink))  # NOTE: while a batch like the last one still fits under it
        count = min(count, len(self.kept) - 1)  # NOTE: the newest chunk stays
        if count > 0:
            self._drop(sink, count)
            used = self._used(sink) if bound is not None and used > bound else used
        return self._over_bound_line(used)

    def _used(self, sink: Sink) -> int:
        used = sink.used_bytes()
        return self.kept_bytes if used is None else used

    def _over_bound_line(self, used: int) -> str | None:
        """Past the bound with only the newest chunk left: what is kept for life fills it."""
        if self.said_over or len(self.kept) > 1:
            return None
        over = over_bound(self.retention.max_bytes, used, self.kept_bytes)
        if over is None:
            return None
        self.said_over = True
        return f"kvscope recorder: run {self.run_id} cannot keep its size bound: {over.text()}; give a larger bound"

    def _past_window(self) -> int:
        keep_s = self.retention.keep_events_s
        if keep_s is None:
            return 0
        cutoff = self.kept[-1].last_t_mono - keep_s
        count = 0
        for mark in self.kept:
            if mark.last_t_mono >= cutoff:
                break
            count += 1
        return count

    def _over_size(self, used: int) -> int:
        """How many of the oldest chunks go: past HIGH_WATER, or when the next batch would not fit,
        down to LOW_WATER (or lower, to leave room for two batches)."""
        bound, batch = self.retention.max_bytes, self.batch_bytes
        if bound is None or (used <= HIGH_WATER * bound and used + batch <= bound):
            return 0
        need, count, freed = used - min(LOW_WATER * bound, bound - 2 * batch), 0, 0
        for mark in self.kept:
            if freed >= need:
                break
            freed += mark.num_bytes
            count += 1
        return count

    def _covered(self, sink: Sink) -> int:
        """How many of the oldest kept chunks the run's ledger checkpoint covers."""
        through = sink.scalar(self.statements.checkpoint, (self.run_id,))
        through = -1 if through is None else int(through)
        count = 0
        for mark in self.kept:
            if mark.last_seq > through:
                break
            count += 1
        return count

    def _drop(self, sink: Sink, count: int) -> None:
        gone = [self.kept[i] for i in range(count)]
        last, first_kept = gone[-1], self.kept[count]
        num_bytes = sum(m.num_bytes for m in gone)
        s = self.statements
        unused = [] if self.strings is None else self.strings.unused_through(last.number).tolist()
        strings = [(s.delete_strings, [(self.run_id, code) for code in unused])] if unused else []
        sink.write(
            [
                *strings,
                (s.delete_columns, [(self.run_id, last.number)]),
                (s.delete_chunks, [(self.run_id, last.number)]),
                (s.delete_snapshots, [(self.run_id, first_kept.first_step)]),
                (s.thin_usage, [(self.run_id, self.thinned_to, first_kept.first_step)]),
                (
                    s.update,
                    [
                        (
                            first_kept.first_seq,
                            first_kept.first_step,
                            self.dropped_chunks + count,
                            self.dropped_bytes + num_bytes,
                            time.time(),
                            self.run_id,
                        )
                    ],
                ),
            ]
        )
        if self.strings is not None and unused:
            self.strings.forget(unused)
        for _ in range(count):
            self.kept.popleft()
        self.kept_bytes -= num_bytes
        self.dropped_chunks += count
        self.dropped_bytes += num_bytes
        self.thinned_to = first_kept.first_step
