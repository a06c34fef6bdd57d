"""An attached engine into a capture: its KV events as kvscope's events, its metrics as usage rows.

    recorder = AttachRecorder("runs/x.db", source)   # source: runs.config["source"] (source_config)
    recorder.apply(frame.batch)                        # each batch the subscriber delivers, in seq order
    recorder.tick(sample)                              # one scrape (kvscope.attach.scrape.EngineSample)
    recorder.close(counters)                           # the last tree snapshot and the "attach" report

NOTE: what a capture of an attached engine holds (schema version 5; docs/attach.md)
    runs       label "attach <engine> <version>", level "summary" (no slots), config["source"]: what
               the source is and what it provides
    usage      one row per scrape (one step = one scrape tick): what the metrics say, NULL where they
               say nothing (vLLM: no available / evictable split); full_used = the engine's own count
    events     the page forest's changes, each at the step of the tick it arrived in:
                 insert      a page first stored on any tier: node_id = its page id (a small int per
                             block hash, stable for the run; the root is 0), aux = its parent's page id,
                             num_tokens = its tokens, pool = the tier's pool (device: full, host: host)
                 write       a device page stored on the host as well (a backup)
                 revive      a host page stored on the device again (a load-back)
                 evict       a page left the device: reason to-host (its host copy stays) or capacity;
                             reset for every device page when the engine's cache was cleared
                 host_evict  a page left the host (reason capacity; reset on a clear)
    tree_snapshots   every SNAPSHOT_EVERY ticks and at close: one row per live page (lock_ref 0, hit_count
               0, owner None: the stream does not say), tier = its tiers joined by "+", the root row first
    reports    kind "attach": the stream's counters at close (delivered, lost_batches, gaps, restarts, ...)
Only a capture made at schema version 5 or later can hold NULL usage (`attach_ready`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import inspect, update

from kvscope import __version__
from kvscope.attach.forest import PageForest
from kvscope.attach.scrape import EngineSample
from kvscope.attach.wire import Batch, Cleared, Removed, Stored, WireEvent
from kvscope.telemetry import schema
from kvscope.telemetry.events import EventKind, EvictReason, PoolName
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.records import NodeRow, PoolTerms, RunStatus, UsageSample
from kvscope.telemetry.retention import Retention
from kvscope.telemetry.store import (
    CaptureError,
    EmptyCaptureError,
    display_name,
    file_of,
    open_reader,
    save_report,
    stored_version,
)

SNAPSHOT_EVERY = 10  # ticks between tree snapshots
PREVIEW_TOKENS = 8
REPORT_KIND = "attach"
POOL_OF_TIER = {"device": PoolName.FULL, "host": PoolName.HOST}
OLD_CAPTURE = "attach needs a capture made by kvscope schema 5 or newer; give a new file"


def attach_ready(target: str | Path) -> None:
    """Refuse (CaptureError, one line) a capture that cannot hold an attached run: one made by a
    kvscope older than schema 5 (its usage columns are NOT NULL, and stay so when upgraded).
    A new or empty target is fine; nothing is written."""
    path = file_of(target)
    if path is not None and (not path.exists() or (path.is_file() and path.stat().st_size == 0)):
        return
    try:
        engine = open_reader(target)
    except EmptyCaptureError:
        return
    try:
        with engine.connect() as conn:
            version = int(stored_version(conn) or 0)
            nullable = {str(c["name"]): bool(c["nullable"]) for c in inspect(conn).get_columns(schema.usage.name)}
    finally:
        engine.dispose()
    not_null = [name for name in schema.ATTACH_NULLABLE_USAGE if not nullable.get(name, True)]
    if version < 5 or not_null:
        raise CaptureError(f"{display_name(target)}: {OLD_CAPTURE}")


def provides(engine: str, subscribed: bool, sample: EngineSample | None = None) -> list[str]:
    """What a source gives (runs.config["source"]["provides"]), from the contract's words."""
    given = set()
    if subscribed:
        given |= {"pages", "evictions"}
    if engine in ("sglang", "kvscope"):
        given |= {"usage.split", "usage.used", "hit_rate", "evictions", "requests.counts"}
    else:
        given |= {"usage.used", "hit_rate", "requests.counts"}
    if sample is not None and sample.host_total_tokens is not None:
        given.add("host_tier")
    return sorted(given)


def source_config(info: Any, url: str, kv_events: dict[str, Any] | None) -> dict[str, Any]:
    """runs.config["source"] of an attached run; `info` is discover's EngineInfo, `kv_events` the
    stream subscribed ({"endpoint", "replay_endpoint", "topic", "bind"}) or None."""
    return {
        "kind": "attach",
        "engine": info.engine,
        "version": info.version,
        "url": url,
        "model": info.model,
        "block_size": info.block_size,
        "capacity_tokens": info.capacity_tokens,
        "kv_events": kv_events,
        "warnings": list(info.warnings),
        "provides": provides(info.engine, kv_events is not None),
    }


class AttachRecorder:
    """Writes an attached engine's forest changes and scrapes through SQLRecorder."""

    def __init__(
        self,
        target: str | Path,
        source: dict[str, Any],
        *,
        snapshot_every: int = SNAPSHOT_EVERY,
        flush_interval_s: float = 0.2,
        retention: Retention | None = None,
    ) -> None:
        attach_ready(target)
        self.target = target
        self.source = source
        self.snapshot_every = snapshot_every
        label = " ".join(["attach", str(source.get("engine")), *([source["version"]] if source.get("version") else [])])
        self.sql = SQLRecorder(
            target,
            level="full",
            label=label,
            config={"source": source},
            flush_interval_s=flush_interval_s,
            retention=retention,  # NOTE: never gated: an attached run's verdict replays no ledger
        )
        with self.sql.engine.begin() as conn:  # NOTE: no slots are ever recorded: readers take it as summary
            conn.execute(update(schema.runs).where(schema.runs.c.id == self.sql.run_id).values(level="summary"))
        self.run_id = self.sql.run_id
        self.sql.step = 1  # NOTE: events belong to the tick that follows them (usage rows from step 1)
        self.forest = PageForest()
        self.page_ids: dict[int, int] = {}
        self.num_events = 0
        self.ticks = 0
        self.capacity_tokens: int | None = source.get("capacity_tokens")
        self.last_sample: EngineSample | None = None
        self.evictions = 0  # device pages that left (events)
        self.closed = False

    # -- events -----------------------------------------------------------------------------------

    def apply(self, batch: Batch) -> None:
        """One delivered batch: its events into the forest, each change recorded as an event."""
        for event in batch.events:
            self._apply_one(event, batch)

    def clear(self) -> None:
        """The engine's cache is gone (a vLLM restart: its stream does not begin with a clear)."""
        self._apply_one(Cleared(), Batch(time.time(), (), None))

    def _apply_one(self, event: WireEvent, batch: Batch) -> None:
        forest = self.forest
        one = Batch(batch.ts, (event,), batch.dp_rank)
        if isinstance(event, Cleared):
            for page_hash, page in list(forest.pages.items()):
                if "device" in page.tiers:
                    self._record(EventKind.EVICT, PoolName.FULL, page_hash, page.num_tokens, EvictReason.RESET)
                if "host" in page.tiers:
                    self._record(EventKind.HOST_EVICT, PoolName.HOST, page_hash, page.num_tokens, EvictReason.RESET)
            forest.apply(one)
            return
        if isinstance(event, Stored):
            hashes = [page_hash for page_hash, _, _ in event.pages()]
        else:
            assert isinstance(event, Removed)
            hashes = list(event.block_hashes)
        before = {
            h: (set(forest.pages[h].tiers), forest.pages[h].num_tokens) if h in forest.pages else None for h in hashes
        }
        forest.apply(one)
        for page_hash in dict.fromkeys(hashes):
            self._changes(page_hash, before[page_hash])

    def _changes(self, page_hash: int, before: tuple[set[str], int] | None) -> None:
        page = self.forest.pages.get(page_hash)
        after = set(page.tiers) if page is not None else set()
        was = before[0] if before is not None else set()
        if page is not None and before is None:
            tier = min(after, key=("device", "host", "disk", "external").index)
            parent = page.parent_hash
            self._record(
                EventKind.INSERT,
                POOL_OF_TIER.get(tier),
                page_hash,
                page.num_tokens,
                aux=self._page_id(parent) if parent is not None and parent in self.forest.pages else 0,
            )
            was = {tier}
        num_tokens = page.num_tokens if page is not None else before[1] if before is not None else 0
        for tier in after - was:
            if tier == "host" and "device" in was:
                self._record(EventKind.WRITE, PoolName.HOST, page_hash, num_tokens)
            elif tier == "device" and was:
                self._record(EventKind.REVIVE, PoolName.FULL, page_hash, num_tokens)
        for tier in was - after:
            if tier == "device":
                reason = EvictReason.TO_HOST if "host" in after else EvictReason.CAPACITY
                self._record(EventKind.EVICT, PoolName.FULL, page_hash, num_tokens, reason)
            elif tier == "host":
                self._record(EventKind.HOST_EVICT, PoolName.HOST, page_hash, num_tokens, EvictReason.CAPACITY)

    def _page_id(self, page_hash: int) -> int:
        found = self.page_ids.get(page_hash)
        if found is None:
            found = self.page_ids[page_hash] = len(self.page_ids) + 1
        return found

    def _record(
        self,
        kind: EventKind,
        pool: PoolName | None,
        page_hash: int,
        num_tokens: int,
        reason: EvictReason | None = None,
        aux: int = 0,
    ) -> None:
        self.sql.record(
            kind, pool=pool, node_id=self._page_id(page_hash), num_tokens=num_tokens, reason=reason, aux=aux
        )
        self.num_events += 1
        if kind is EventKind.EVICT:
            self.evictions += 1

    # -- scrapes ----------------------------------------------------------------------------------

    def tick(self, sample: EngineSample | None) -> None:
        """One scrape tick: the usage row (none when the scrape failed), and every
        `snapshot_every` ticks a tree snapshot. The events since the last tick belong to it."""
        self.ticks += 1
        step = self.ticks
        if sample is not None:
            self.last_sample = sample
            if sample.capacity_tokens is not None:
                self.capacity_tokens = sample.capacity_tokens
            self.sql.usage(self._usage_row(step, sample))
        if step % self.snapshot_every == 0:
            self.sql.tree_snapshot(step, self.tree_rows())
        self.sql.step = step + 1  # NOTE: events from now on arrive during the next tick

    def _usage_row(self, step: int, s: EngineSample) -> UsageSample:
        nothing: Any = None  # NOTE: NULL in the capture: the source does not say (schema version 5)
        host = None
        if s.host_total_tokens is not None:
            host_available = nothing if s.host_used_tokens is None else s.host_total_tokens - s.host_used_tokens
            host = PoolTerms(s.host_total_tokens, host_available, nothing, nothing)
        evicted = s.evicted_tokens_total
        if evicted is None and self.source.get("kv_events") is not None:
            evicted = self.forest.tiers["device"].num_removed_tokens  # the stream's evictions, cumulative
        return UsageSample(
            step=step,
            full=PoolTerms(self.capacity_tokens or 0, _n(s.available_tokens), _n(s.evictable_tokens), nothing),
            swa=None,
            req_total=nothing,
            req_available=nothing,
            num_running=_n(s.num_running),
            num_waiting=_n(s.num_waiting),
            cum_prompt_tokens=_n(s.prompt_tokens_total),
            cum_hit_tokens=_n(s.cached_tokens_total),
            cum_requests=nothing,
            cum_hit_requests=nothing,
            cum_evicted_tokens=_n(evicted),
            cum_retractions=_n(s.preemptions_total),
            host=host,
            cum_host_hit_tokens=_n(s.host_cached_tokens_total),
            cum_written_tokens=nothing,
            cum_loaded_tokens=nothing,
            full_used=s.used_tokens,
        )

    def tree_rows(self) -> list[NodeRow]:
        """The forest now as snapshot rows: the root (0), then every live page, parents first."""
        offset = time.monotonic() - time.time()  # NOTE: batch times are wall seconds; rows keep monotonic ones
        rows = [NodeRow(0, None, 0, "", 0, 0.0, 0, None, False, 0, page_hashes=b"")]
        for page in self.forest.snapshot(PREVIEW_TOKENS):
            parent = self._page_id(page.parent_hash) if page.parent_hash is not None and not page.orphan else 0
            preview = " ".join(map(str, page.token_preview)) + (" …" if page.num_tokens > PREVIEW_TOKENS else "")
            rows.append(
                NodeRow(
                    self._page_id(page.page_hash),
                    parent,
                    page.num_tokens,
                    preview,
                    0,
                    page.stored_at + offset,
                    0,
                    None,
                    False,
                    page.depth_tokens,
                    "public",
                    "+".join(page.tiers),
                    page_hash_bytes(page.page_hash),
                )
            )
        return rows

    # -- closing ----------------------------------------------------------------------------------

    def close(self, counters: dict[str, Any], status: str = RunStatus.FINISHED, error: str | None = None) -> None:
        """The last tree snapshot, the run closed, and the "attach" report (the stream's counters
        and the forest's). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.sql.tree_snapshot(self.sql.step, self.tree_rows())
        self.sql.close(status, error)
        body = {
            **counters,
            "unknown_removes": self.forest.unknown_removes,
            "orphans": self.forest.num_orphans,
            "resets": self.forest.resets,
            "ignored_events": self.forest.ignored_events,
            "evictions": self.evictions,
            "ticks": self.ticks,
        }
        if self.sql.failure is None:
            try:
                save_report(
                    self.target,
                    self.run_id,
                    REPORT_KIND,
                    self.num_events - 1,
                    f"kvscope {__version__}",
                    json.dumps(body, sort_keys=True),
                )
            except CaptureError as err:
                print(f"kvscope attach: {err}", file=sys.stderr)


def _n(value: int | None) -> Any:
    """A count the source may not give: None is stored as NULL (schema version 5)."""
    return value


def page_hash_bytes(page_hash: int) -> bytes:
    """The engine's block hash as a snapshot's page_hashes (its low 64 bits, big-endian: SGLang's
    signed int64 block hash gives back its digest's first 8 bytes, as kvscope's own caches store)."""
    return (page_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
