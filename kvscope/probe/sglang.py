"""The probe inside SGLang's scheduler process: hooks on the allocators, the request-row pool and the
radix trees of the code families in FAMILIES (shapes.py), registered through SGLang's own plugin framework
(HookRegistry, AROUND hooks; the allocators' and the trees' hot methods patched directly, see `_register`), and the
page census (sglang_census.py) at each idle point, periodically while busy and as the scheduler loop ends; the
page ledger (Mamba slots included) in sglang_ledger.py; what a census and a snapshot read of SGLang's pools
and trees in sglang_views.py.

Loaded by SGLang's `sglang.srt.plugins` entry point (`register`): `load_plugins()` runs it first
thing in every SGLang process (the scheduler, spawned, included); inert unless KVSCOPE_CAPTURE is
set. All or nothing: every target is resolved before the first hook is registered; a release whose
code matches no family's shapes (shapes.choose), or a target that is gone, registers nothing and says
so in one line.

NOTE: what each action records (pool = full, or swa for an SWA allocator's sub-pool; slots = page
ids, num_tokens = pages x page size; rid = the request the probe's context names, None outside one)
    alloc    the paged allocator's alloc / alloc_extend / alloc_decode, the token allocator's alloc:
             the new pages; each page's taker in the ledger
    free     _release_page_ids (the one sink every paged free passes through, groups included), the
             token allocator's free outside a free group: the pages back in the free list
    bind     ScheduleBatch.prepare_for_extend / prepare_for_decode: the pages of the slots each request's
             row gained since its last bind are its own, and their SWA peers (the ledger's taker becomes
             that request; no event: the alloc was recorded already)
    match    match_prefix: num_tokens = hit tokens, aux = missed tokens
    insert   insert: num_tokens = the tokens the request added to the tree
    lock / unlock  inc_lock_ref / dec_lock_ref: node_id = the node (the lock ledger's holder)
    evict    evict / evict_for_alloc: num_tokens = tokens evicted, reason capacity
    host_evict / load / write  the HiCache component's evict_host / load_back / backup_kv_cache
    alloc / free (pool mamba)  MambaSlotAllocator.alloc / free: slots = Mamba state slot ids, num_tokens =
             slots; each slot's taker / releaser in the allocator's mamba ledger, and prepare_for_extend
             binds each request's row slots to it (the same queue and fold as the pages)
    retract  ScheduleBatch.retract_decode: each retracted request (num_tokens = its output tokens)
NOTE: the request context (rid) is the request whose own call runs: release_kv_cache, the tree's
checkpoint, PrefillAdder's admission (its lock); None for a batch's calls (prepare_for_*, a free
group's end: event group) and outside any hook; a match names its request on its own event only.
The census (Scheduler.on_idle after SGLang's own check; before SGLang raises: _report_leak,
_check_req_pool, any other raise out of on_idle; busy: before ingest_requests (process_input_requests before
0.5.20), first in each iteration of the normal and overlap loops, when due; drain / crash: as run_event_loop
returns / raises, then the run closes as the loop ended) writes one leak check per pool, of its kind, and
every page it names (census_blocks) (full; swa under an SWA allocator, read through SGLang's full -> SWA slot
mapping; req; mamba under a HybridReqToTokenPool's MambaSlotAllocator) and a tree snapshot (tree_rows); a
request record per release_kv_cache (not at a retraction's). Per step a usage sample from
the allocator's and the tree's own counters (available, evictable, protected; written when the next
step begins, or by the census), and a tree snapshot every SNAPSHOT_EVERY_STEPS steps while busy.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing.util
import operator
import os
import pkgutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any, NamedTuple

from kvscope.probe.core import (
    CENSUS_BUDGET_X,
    LAST_CENSUS,
    LEVELS,
    ProbeState,
    Settings,
    busy_census_due,
    census_clock,
    engine_ending,
    guarded,
    installed_version,
    open_recorder,
    refuse,
    register_never_raising,
    say,
    settings_from_env,
)
from kvscope.probe.metrics import CensusTally
from kvscope.probe.sglang_census import census_blocks, census_checks, census_line, take_page_census, violation
from kvscope.probe.sglang_ledger import (
    ALLOC,
    BIND,
    FREE,
    PageLedger,
    _gather,
)
from kvscope.probe.sglang_metrics import SglangMetrics, page_terms
from kvscope.probe.sglang_shapes import (
    ADDER,
    BASE,
    BATCH,
    CHECKER,
    MAMBA_SLOTS,
    PAGED,
    RADIX,
    READS_0518,
    READS_0519,
    READS_0521,
    RELEASE,
    ROWS,
    SCHEDULER,
    SWA,
    TOKEN,
    UNIFIED,
    Hook,
    _family,
)
from kvscope.probe.sglang_views import (
    Holder,
    kv_span_0518,
    live_pages,
    mamba_allocator,
    mamba_view,
    page_view,
    row_view,
    session_holders,
    session_holders_0518,
    stale_locked_pages,
    swa_pool,
    swa_view,
    tree_rows,
    tree_slots,
)
from kvscope.probe.shapes import Family, choose, describe
from kvscope.telemetry import EventKind, EvictReason, PoolTerms, RequestRecord, UsageSample
from kvscope.telemetry.remote import signals_held

ENGINE = "sglang"
MATCH_V, INSERT_V, LOCK_V, UNLOCK_V, EVICT_V = (
    k._value_ for k in (EventKind.MATCH, EventKind.INSERT, EventKind.LOCK, EventKind.UNLOCK, EventKind.EVICT)
)
HOST_EVICT_V, LOAD_V, WRITE_V = (k._value_ for k in (EventKind.HOST_EVICT, EventKind.LOAD, EventKind.WRITE))
ALLOC_V, FREE_V = EventKind.ALLOC._value_, EventKind.FREE._value_
RETRACT_V = EventKind.REQUEST_RETRACT._value_
CAPACITY_V = EvictReason.CAPACITY._value_


class LiveReader(NamedTuple):
    """How a family reads the scheduler's live requests: `owners`, SGLang's invariant checker -> the
    requests that own a row; `lock_nodes`, those requests -> the tree node each one's prefix lock is on;
    `kv_of`, a request -> its KV record (req_pool_idx, cache_protected_len, kv_allocated_len: its own
    ReqKvInfo from 0.5.19, a KvSpan of what 0.5.18 keeps on the request); `sessions`, the tree -> its
    streaming sessions' records and the nodes they hold locked (sglang_views.session_holders)."""

    owners: Callable[[Any], list[Any]]
    lock_nodes: Callable[[list[Any]], list[Any]]
    kv_of: Callable[[Any], Any] = operator.attrgetter("kv")
    sessions: Callable[[Any], tuple[list[Holder], list[Any]]] = session_holders


TREE_METHODS = ("match_prefix", "insert", "evict", "inc_lock_ref", "dec_lock_ref")  # NOTE: patched at level full
_KV = operator.attrgetter("kv")  # NOTE: a request's KV record from 0.5.19 (LiveReader.kv_of)
SNAPSHOT_EVERY_STEPS = 256  # NOTE: while busy; a snapshot walks every node (as the idle census does)
_monotonic = time.monotonic


class SglangProbe:
    """The probe's state in one process: the recorder, whom the pools work for, the ledgers."""

    def __init__(self, settings: Settings | None, version: str) -> None:
        self.settings = settings
        self.version = version
        self.lean = settings is not None and settings.level == "summary"  # NOTE: no per-operation hook (hooks)
        self.state = ProbeState(engine=ENGINE)
        self.pid = -1
        self.hot = False
        self.dp_rank: int | None = None  # NOTE: SGLang's DP rank of this scheduler, read as the recorder opens
        self.step = 0
        self.emit: Callable[[Iterable[Any]], None] | None = None
        self.emit_block: Callable[[tuple[Any, ...]], None] | None = None  # NOTE: the fold's events, in bulk
        self.rid: str | None = None  # NOTE: the request the pools work for now
        self.event = "alloc"
        self.busy = False  # NOTE: something moved since the last census
        self.ledger = ledger = PageLedger()
        self.pending = ledger.pending  # NOTE: the ledger's own queue and dicts (emptied in place, never replaced)
        self.pools, self.takers, self.releasers = ledger.pools, ledger.takers, ledger.releasers
        self.locks: dict[Any, list[tuple[str | None, int]]] = {}  # node -> [(rid, step) of each open lock]
        self.recorded: set[str] = set()
        self.cum = [
            0,
            0,
            0,
            0,
            0,
            0,
        ]  # NOTE: prompt tokens, hit tokens, requests, hit requests, evicted tokens, retractions
        self.censuses = 0
        self.retractions: dict[str, int] = {}  # NOTE: rid -> retractions so far (its row takes them at release)
        self.retract_marks: dict[str, tuple[int, float]] = {}  # NOTE: rid -> (step, time) of its last retraction
        self.census_step = -1
        self.roots: dict[int, Any] = {}  # id(tree) -> its root handle
        self.sources: tuple[Any, Any, int] | None = None  # (tree, full allocator, batch size) of the last prepare
        self.usage_step = -1
        self.now = _monotonic()  # NOTE: read once per step (next_step) and per drain, not per event
        self.bound: dict[int, int] = {}  # NOTE: row -> the length whose pages bind gave its request (row hooks reset)
        self.tally = CensusTally()  # NOTE: the stored censuses, for SGLang's /metrics (sglang_metrics.py)
        self.metrics = SglangMetrics()
        self.in_loop = False  # NOTE: inside SGLang's normal or overlap event loop (busy censuses run only there)
        self.last_census_t = _monotonic()  # NOTE: when the last census ended (or the probe started)
        self.census_cost_s = 0.0  # NOTE: the scheduler thread's CPU time in the last census
        self.last_said: tuple[str, ...] = ()  # NOTE: the failing pools' lines the last census printed
        self.patched: dict[str, dict[type, Any]] = {}  # NOTE: method name -> {SGLang's class: the probe's method}
        self.trees_seen: set[type] = set()  # NOTE: the tree classes whose hooked methods were checked (tree_unseen)

    def publish(self, scheduler: Any) -> None:
        """The censuses so far into SGLang's /metrics, labelled as the scheduler's series (never raises)."""
        failure = getattr(self.state.recorder, "failure", None)
        recording = self.state.active and failure is None
        with suppress(Exception):  # NOTE: the metrics are the engine's; a failure here is not the engine's
            self.metrics.publish(scheduler, self.tally, recording, None if recording else self.state.reason or failure)

    # -- the recorder ---------------------------------------------------------------------------

    def recorder(self) -> Any:
        """This process's recorder, opened at its first event; None once recording stopped."""
        if not self.state.active:
            return None
        if self.pid != os.getpid():
            self.pid = os.getpid()
            assert self.settings is not None
            self.hot, self.emit, self.emit_block = False, None, None
            with guarded(self.state):
                self.dp_rank = _dp_rank()
                rank = "" if self.dp_rank is None else f"dp {self.dp_rank} "
                rec = self.state.recorder = open_recorder(
                    self.settings,
                    label=f"sglang {self.version} probe {rank}pid {self.pid}",
                    config=self.config(patched=True),
                )
                self.step = rec.step
                self.emit = rec.item_sink() if rec.enabled else None
                self.emit_block = rec.event_block if rec.enabled else None
                self.hot = True
                atexit.register(self.drain_at_exit)  # NOTE: after the recorder's own: runs before its close
                multiprocessing.util.Finalize(None, self.drain_at_exit, exitpriority=101)  # NOTE: a spawned scheduler
            if not self.state.active:
                return None
        return self.state.recorder

    def drain_at_exit(self) -> None:
        """The calls since the last fold (and a background fold's), into the capture before the recorder closes."""
        if self.state.active:
            with guarded(self.state):
                self.drain()

    def config(self, *, patched: bool, reason: str | None = None) -> dict[str, Any]:
        return {
            "source": {
                "kind": "probe",
                "engine": ENGINE,
                "version": self.version,
                "patched": patched,
                "reason": reason,
                "pid": os.getpid(),
                "dp_rank": self.dp_rank,
                "census": "pages",
                "provides": ["pages", "ownership", "locks", "leak_checks", "requests", "usage.split"],
                "lacks": ["evictions"] if self.lean else [],  # NOTE: no tree hook at summary: nothing counts them
            }
        }

    def next_step(self) -> None:
        rec = self.recorder()
        if rec is not None:
            now = _monotonic()  # NOTE: the one clock read per step; this step's tree events carry it
            self.fold_if_due(now)
            if self.sources is not None and self.usage_step != rec.step:
                self.step_usage(rec, *self.sources)
            rec.step = rec.step + 1
            self.step = rec.step
            self.now = self.ledger.step_now[self.step] = now

    def fold_if_due(self, now: float) -> None:
        """The per-step part of the ledger's work: the event blocks folded since the last step to the
        recorder, and a fold every FOLD_CALLS entries or FOLD_INTERVAL_S, on the ledger's worker thread
        (a census's drain folds what is left on this thread first)."""
        ledger = self.ledger
        emit = self.emit_block if self.emit is not None else None
        if ledger.blocks or ledger.failure is not None:
            ledger.hand_over(emit)
        if ledger.due(now):
            folded = ledger.fold_later(self.step, emit is not None)
            if folded is not None:
                self.now = folded
                self.busy = True

    def drain(self) -> None:
        """Fold the calls and binds queued since the last fold into the ledger (and, level full,
        their events): PageLedger.drain."""
        now = self.ledger.drain(self.step, self.emit_block if self.emit is not None else None)
        if now is not None:
            self.now = now
            self.busy = True

    def tree_unseen(self, tree: Any) -> str | None:
        """Why the probe cannot see this tree's calls, once per tree class: a class that overrides a tree
        method the probe patched on a class it derives from (SGLang 0.5.18's HiRadixCache, built for a plain
        model with --enable-hierarchical-cache, overrides RadixCache's match, insert, evict and locks); None
        when each such method of its class is the probe's (a tree that wraps one, not derived from it, calls
        the wrapped tree's own)."""
        cls = type(tree)
        if cls in self.trees_seen:
            return None
        self.trees_seen.add(cls)
        for name in TREE_METHODS:
            for owner, made in self.patched.get(name, {}).items():
                if issubclass(cls, owner) and getattr(cls, name, None) is not made:
                    return f"{cls.__name__}.{name} overrides the tree method the probe patched, so its calls go unseen"
        return None

    def prepared(self, reqs: Any, rows: Any, tree: Any, event: str, kv_of: Callable[[Any], Any] = _KV) -> None:
        """After SGLang's prepare_for_extend / prepare_for_decode: the batch's row pages bound to its
        requests (`kv_of`: the family's reader of a request's KV record, LiveReader); the pool's counters
        kept by reference for this step's usage sample (written when the next step begins); a tree
        snapshot every SNAPSHOT_EVERY_STEPS steps. A tree whose calls the probe cannot see (tree_unseen)
        stops recording: its ledger would be partial."""
        unseen = self.tree_unseen(tree)
        if unseen is not None:
            self.state.stop(f"SGLang {self.version}: {unseen}; nothing more is recorded (no partial ledger)")
            return
        allocator = tree.token_to_kv_pool_allocator
        full = getattr(allocator, "full_attn_allocator", allocator)
        page_size = int(full.page_size)
        swa = swa_pool(allocator)
        peers = None if swa is None else (allocator.full_to_swa_index_mapping, swa)
        self.bind_requests(reqs, rows, page_size, full, event, peers, kv_of)
        if event == "extend" and getattr(rows, "req_index_to_mamba_index_mapping", None) is not None:
            self.bind_mamba(reqs, rows, kv_of)
        self.sources = (tree, full, len(reqs))
        rec = self.recorder()
        if rec is not None and rec.step % SNAPSHOT_EVERY_STEPS == 0:
            holders = [Holder(req.rid, kv_of(req)) for req in reqs]
            rec.tree_snapshot(rec.step, tree_rows(tree, live_pages(rows, holders, page_size), page_size))

    def step_usage(self, rec: Any, tree: Any, full: Any, running: int) -> None:
        """One usage sample from the allocator's and the tree's own counters (no page is walked)."""
        total = int(full.size)
        available = int(full.available_size())
        terms = PoolTerms(total, available, int(tree.evictable_size()), int(tree.protected_size()))
        c = self.cum
        rec.usage(
            UsageSample(
                rec.step,
                terms,
                None,
                0,
                0,
                running,
                0,
                c[0],
                c[1],
                c[2],
                c[3],
                c[4],
                c[5],
                full_used=total - available,
            )
        )
        self.usage_step = rec.step

    def bind_requests(
        self,
        reqs: Any,
        rows: Any,
        page_size: int,
        allocator: Any,
        event: str,
        peers: tuple[Any, Any] | None = None,
        kv_of: Callable[[Any], Any] = _KV,
    ) -> None:
        """Each request's row pages are its own (after prepare_for_extend / prepare_for_decode): the
        slots its row gained since its last bind (a decode step: one per request), not the whole row,
        gathered from the rows in one copy (a row's slots change once its request is gone) and queued
        for the next fold, after the allocator calls before it; `peers` = (SGLang's full -> SWA slot
        mapping, the SWA sub-allocator): their SWA pages too (page_size: the full pool's)."""
        table = rows.req_to_token
        bound = self.bound
        rids: list[str] = []
        starts: list[int] = []
        parts: list[int] = []
        width = table.shape[1]
        for req in reqs:
            kv = kv_of(req)
            if kv.req_pool_idx is None:
                continue
            row, end = kv.req_pool_idx, kv.kv_allocated_len
            start = max(kv.cache_protected_len, bound.get(row, 0))
            if start > end:  # NOTE: the row shrank: bind it again from the protected length
                start = kv.cache_protected_len
            if end > start:
                rids.append(req.rid)
                starts.append(row * width + start)
                parts.append(end - start)
            bound[row] = end
        if not rids:
            return
        slots = _gather(table, starts, parts)
        self.pending.extend((BIND, allocator, rids, self.step, event, slots, parts))
        if peers is not None:
            mapping, swa = peers
            self.pending.extend((BIND, swa, rids, self.step, event, mapping[slots], parts))

    def bind_mamba(self, reqs: Any, rows: Any, kv_of: Callable[[Any], Any] = _KV) -> None:
        """After prepare_for_extend: each request's Mamba slots (its row's mamba index, and its
        ping-pong track slots with SGLang's extra buffer: -1 where empty, dropped by the fold) are its
        own. HybridReqToTokenPool.alloc takes them in the batch's prepare, where no request is the
        context: one gather from the row mappings, queued as a bind (no tensor read here)."""
        rids, picked = [], []
        for req in reqs:
            row = kv_of(req).req_pool_idx
            if row is not None:
                rids.append(req.rid)
                picked.append(int(row))
        if not rids:
            return
        mapping = rows.req_index_to_mamba_index_mapping
        index = mapping.new_tensor(picked).long()
        slots, width = mapping[index].long(), 1
        if getattr(rows, "enable_mamba_extra_buffer", False):  # NOTE: [rows, track slots], -1 where empty
            track = rows.req_index_to_mamba_ping_pong_track_buffer_mapping[index]
            width = 1 + track.shape[1]
            slots = sys.modules["torch"].cat((slots.unsqueeze(1), track.long()), 1).reshape(-1)
        self.pending.extend((BIND, rows.mamba_allocator, rids, self.step, "extend", slots, [width] * len(rids)))

    def retracted_requests(self, reqs: Iterable[Any]) -> None:
        """retract_decode's retracted requests: counted, and a retract event each (num_tokens = the
        output tokens it had)."""
        rec = self.recorder()
        if rec is None:
            return
        for req in reqs:
            self.retractions[req.rid] = self.retractions.get(req.rid, 0) + 1
            self.retract_marks[req.rid] = (self.step, _monotonic())
            self.cum[5] += 1
            if self.emit is not None:
                self.emit(
                    (self.step, self.now, RETRACT_V, "full", req.rid, None, len(req.output_ids), 0, None, None, None)
                )

    # -- the census -----------------------------------------------------------------------------

    def busy_census_due(self) -> bool:
        """A busy census is due: core.busy_census_due over the steps and seconds since the last census."""
        steps_since = self.step - max(self.census_step, 0)
        since_s = _monotonic() - self.last_census_t
        return busy_census_due(self.settings, steps_since, since_s, self.census_cost_s, CENSUS_BUDGET_X)

    def end_run(self, scheduler: Any, err: BaseException | None, live: LiveReader) -> None:
        """SGLang's scheduler loop ended (`err`: what it raised): the last census, kind by how it ended
        (core.LAST_CENSUS: drain after a shutdown, crash after an error, none when interrupted), then the
        run closes as the loop ended (core.engine_ending; a shutdown was asked for once SGLang's
        ShutdownReq set gracefully_exit). Never raises."""
        if not self.state.active or self.pid != os.getpid():
            return
        ending = engine_ending(err, shutdown_asked=getattr(scheduler, "gracefully_exit", False) is True)
        kind = LAST_CENSUS.get(ending.status)
        with signals_held():  # NOTE: a signal's handler must not cut the last census or the close off
            if kind is not None:
                with guarded(self.state):
                    checker = scheduler.invariant_checker
                    owners = live.owners(checker)
                    tree, rows = checker.tree_cache, checker.req_to_token_pool
                    self.census(tree, rows, owners, why=kind, kind=kind, live=live)
                    for req in owners:  # NOTE: the rows of those still running (the census saw their pages held)
                        _record_request(req, unfinished=True)
                self.publish(scheduler)
            if self.state.active:
                with guarded(self.state):
                    self.drain()  # NOTE: the calls since the last fold (none after a census)
                    self.state.active = False
                    self.state.recorder.close(*ending)

    def census(
        self,
        tree: Any,
        rows: Any,
        owners: list[Any],
        *,
        why: str,
        kind: str = "idle",
        live: LiveReader | None = None,
    ) -> Any:
        """Every page of each pool is exactly one of free / in the tree / in a live request's row (a
        streaming session's record counts as one: session_holders); stored as leak checks (one per
        pool) of census `kind` (busy, idle, drain, crash) with every page it names, and a usage
        sample, before anything else happens; a tree snapshot too, but at a busy census. `live`: the
        family's reader of the requests' locks, KV records and the tree's sessions (LIVE when None)."""
        rec = self.recorder()
        if rec is None:
            return None
        started = census_clock()
        self.drain()
        self.busy = False
        self.censuses += 1
        if rec.step == self.census_step:  # NOTE: one census per step (a second idle point without a step between)
            self.next_step()
        self.census_step = rec.step
        allocator = tree.token_to_kv_pool_allocator
        full = getattr(allocator, "full_attn_allocator", allocator)
        live = live or LIVE
        sessions, session_locks = live.sessions(tree)
        lock_nodes = [*live.lock_nodes(owners), *session_locks]
        kv_of = live.kv_of
        owners = [*(Holder(req.rid, kv_of(req)) for req in owners), *sessions]  # NOTE: SGLang's owners leave out
        # a session's record; it is held, not leaked
        live_rids = {holder.rid for holder in owners}
        live_locks = Counter(_node(node) for node in lock_nodes)
        open_locks = {node: stale_locks(held, live_rids, live_locks[node]) for node, held in self.locks.items()}
        in_tree = tree_slots(tree)
        view = page_view(full, in_tree, rows, owners)
        locked = (  # NOTE: no lock ledger at summary: the tree's own counts against the live holders' locks
            stale_locked_pages(tree, lock_nodes, view.live, view.page_size) if self.lean else None
        )
        result = take_page_census(
            "full",
            view,
            self.takers["full"],
            self.releasers["full"],
            {n: h for n, h in open_locks.items() if h},
            locked,
        )
        results = [result]
        swa = swa_pool(allocator)
        if swa is not None:
            swa_pages = swa_view(allocator, swa, in_tree, rows, owners)
            results.append(take_page_census("swa", swa_pages, self.takers["swa"], self.releasers["swa"], {}))
        row_result = take_page_census("req", row_view(rows, owners), self.takers["req"], self.releasers["req"], {})
        results.append(row_result)
        slots = mamba_allocator(rows)
        if slots is not None:
            takers, releasers = self.takers["mamba"].get(id(slots), {}), self.releasers["mamba"].get(id(slots), {})
            results.append(take_page_census("mamba", mamba_view(tree, rows, slots, owners), takers, releasers, {}))
        for check in census_checks(rec.step, results, kind):
            rec.leak_check(check)
        rec.census_blocks(census_blocks(rec.step, results))
        self.tally.note_counts(rec.step, page_terms(results), kind)
        ps = view.page_size
        used = (view.num_pages - len(result.free)) * ps
        terms = PoolTerms(view.num_pages * ps, len(result.free) * ps, len(result.tree - result.live) * ps, 0)
        c = self.cum
        if self.usage_step != rec.step:
            rec.usage(
                UsageSample(
                    rec.step,
                    terms,
                    None,
                    0,
                    0,
                    len(owners),
                    0,
                    c[0],
                    c[1],
                    c[2],
                    c[3],
                    c[4],
                    c[5],
                    full_used=used,
                )
            )
            self.usage_step = rec.step
        if kind != "busy":  # NOTE: while busy, prepared() takes one every SNAPSHOT_EVERY_STEPS steps
            rec.tree_snapshot(rec.step, tree_rows(tree, view.live, ps))
        self.say_failures(results, rec, why, repeat=kind != "busy")
        if kind != "busy" or not all(r.ok for r in results):  # NOTE: a failing census is handed on now
            rec.flush() if hasattr(rec, "flush") else rec.idle()
        self.last_census_t = _monotonic()
        self.census_cost_s = census_clock() - started
        self.tally.spent(self.census_cost_s)
        return tuple(results)

    def say_failures(self, results: list[Any], rec: Any, why: str, *, repeat: bool) -> None:
        """Each failing pool's line into SGLang's log (`kvscope report engine-log` reads it); a busy census
        that finds what the last census printed says nothing (a leak stays until a restart)."""
        failed = tuple(f"{r.pool} {violation(r)}" for r in results if not r.ok)
        if not repeat and failed == self.last_said:
            return
        self.last_said = failed
        for r in (r for r in results if not r.ok):
            capture = self.settings.capture if self.settings else ""
            say(census_line(r, why=why, capture=capture, run_id=getattr(rec, "run_id", None), step=rec.step))


# -- the hooks (SGLang's AROUND form: hook(original, *args, **kwargs)) --------------------------------
# NOTE: each calls the original exactly as SGLang did; kvscope's part runs only while recording and
# its first exception stops recording (one line) without reaching SGLang.

PROBE = SglangProbe(None, "")


def _dp_rank() -> int | None:
    """This scheduler's data-parallel rank as SGLang published it for its process (runtime_context's
    parallel ranks, 0.5.23: the replica a DP controller spawned it for); None without one, or where
    nothing was published (a read of an unpublished rank raises)."""
    context = sys.modules.get("sglang.srt.runtime_context")
    try:
        rank = None if context is None else context.get_parallel().dp_rank
    except Exception:
        return None
    return rank if type(rank) is int else None


def _failed(err: Exception) -> None:
    PROBE.state.stop(f"{type(err).__name__}: {err}".splitlines()[0])


def _ready() -> bool:
    probe = PROBE
    return probe.state.active and (probe.hot or probe.recorder() is not None)


# NOTE: the allocator hooks are hot (every alloc and free of every step): they only append the call's
# index tensor with who and when to PROBE.pending; `drain` folds them into the ledger and events in
# bulk, at most every FOLD_INTERVAL_S or FOLD_CALLS calls, and at each census. A tensor kept by
# reference must not change after the call (0.5.23's allocator.{paged,token}):
#     paged alloc / alloc_extend / alloc_decode  a new tensor per call (computed, or torch.empty filled)
#     token alloc   a slice of free_pages, which SGLang only ever replaces (cat, sort), never writes
#     _release_page_ids  torch.unique / torch.cat / a free group's copy / a fresh mapping lookup; with
#                   need_sort SGLang keeps the same tensors in staged_pages itself
#     token free    may be a view of a request's row in req_to_token (page size 1), rewritten once
#                   the row is reused: copied when it is a view, else kept
#     mamba alloc   a pop the probe saw: no tensor, its place in the free list; else a slice of
#                   free_slots or of a group's batch, which SGLang only ever replaces
#     mamba free    often a view SGLang rewrites: not kept; the bytes it added are queued, its slots
#                   kept in the tail of the free_slots SGLang makes (PageLedger.slot_runs)


# NOTE: patched directly (Hook.direct): each factory takes SGLang's method and returns the method
# put on the class in its place, with the same parameters (checked at registration: `_direct`).
# SGLang's HookRegistry AROUND layer (wrapper(*args, **kwargs) -> hook(original, *args, **kwargs))
# forwards the arguments twice, about 0.35 µs a call; these methods run several times per step.
# Why and what: docs/probe.md "Why the allocators are patched directly".


def _d_alloc(original: Callable[..., Any]) -> Callable[..., Any]:
    """alloc(need_size) of the paged and the token allocator."""

    @functools.wraps(original)
    def alloc(self: Any, need_size: int) -> Any:
        out = original(self, need_size)
        probe = PROBE
        if out is not None and probe.state.active and (probe.hot or _ready()):
            probe.pending.extend((ALLOC, self, probe.rid, probe.step, "alloc", out, None))
        return out

    return alloc


def _d_alloc_extend(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def alloc_extend(
        self: Any,
        prefix_lens: Any,
        prefix_lens_cpu: Any,
        seq_lens: Any,
        seq_lens_cpu: Any,
        last_loc: Any,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> Any:
        out = original(
            self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages
        )
        probe = PROBE
        if out is not None and probe.state.active and (probe.hot or _ready()):
            probe.pending.extend((ALLOC, self, probe.rid, probe.step, "alloc", out, None))
        return out

    return alloc_extend


def _d_alloc_decode(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def alloc_decode(self: Any, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> Any:
        out = original(self, seq_lens, seq_lens_cpu, last_loc)
        probe = PROBE
        if out is not None and probe.state.active and (probe.hot or _ready()):
            probe.pending.extend((ALLOC, self, probe.rid, probe.step, "alloc", out, None))
        return out

    return alloc_decode


def _d_release_pages(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _release_page_ids(self: Any, *page_ids: Any) -> Any:
        probe = PROBE
        if probe.state.active and (probe.hot or _ready()):
            for ids in page_ids:
                probe.pending.extend((FREE, self, probe.rid, probe.step, probe.event, ids, None))
        return original(self, *page_ids)

    return _release_page_ids


def _d_token_free(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def free(self: Any, free_index: Any) -> Any:
        probe = PROBE
        if self.free_group is None and probe.state.active:  # NOTE: in a group, free_group_end calls free again
            try:
                if (probe.hot or _ready()) and free_index.numel():
                    kept = free_index if free_index._base is None else free_index.clone()
                    probe.pending.extend((FREE, self, probe.rid, probe.step, probe.event, kept, None))
            except Exception as err:
                _failed(err)
        return original(self, free_index)

    return free


def _rows_alloc(kv_of: Callable[[Any], Any]) -> Callable[..., Any]:
    """ReqToTokenPool.alloc(reqs): each row's taker; `kv_of` reads the row SGLang gave each request."""

    def hook(original: Callable[..., Any], self: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
        return _rows_taken(original(self, reqs, *args, **kwargs), reqs, kv_of)

    return hook


_h_rows_alloc = _rows_alloc(_KV)  # NOTE: ReqToTokenPool.alloc from 0.5.19 (the row on the request's ReqKvInfo)


def _rows_taken(result: Any, reqs: Any, kv_of: Callable[[Any], Any]) -> Any:
    if result is not None and PROBE.state.active:
        try:
            if _ready():
                takers, bound, step = PROBE.takers["req"], PROBE.bound, PROBE.step
                for req in reqs:
                    row = int(kv_of(req).req_pool_idx)
                    takers[row] = (req.rid, step, "alloc")
                    bound.pop(row, None)
        except Exception as err:
            _failed(err)
    return result


def _h_rows_free(original: Callable[..., Any], self: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
    """ReqToTokenPool.free_rows(indices) (0.5.19 on): each row's releaser."""
    if PROBE.state.active:
        _rows_released(indices)
    return original(self, indices, *args, **kwargs)


def _h_rows_free_0518(original: Callable[..., Any], self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """ReqToTokenPool.free(req) (SGLang 0.5.18: the pool frees the request's own row, req.req_pool_idx,
    and clears it): that row's releaser."""
    if PROBE.state.active:
        row = getattr(req, "req_pool_idx", None)  # NOTE: read before SGLang clears it; never raises into SGLang
        _rows_released(() if row is None else (row,))
    return original(self, req, *args, **kwargs)


def _rows_released(indices: Any) -> None:
    try:
        if _ready():
            releasers, bound, entry = PROBE.releasers["req"], PROBE.bound, (PROBE.rid, PROBE.step, PROBE.event)
            for row in indices:
                releasers[int(row)] = entry
                bound.pop(int(row), None)
    except Exception as err:
        _failed(err)


def _d_mamba_alloc(original: Callable[..., Any]) -> Callable[..., Any]:
    """MambaSlotAllocator.alloc(need_size). A pop off the head of the open slot run's free_slots (see
    _d_mamba_free) is queued by its place in the run's chain: the free_slots the chain began with,
    then the slots its frees gave back, in order (a FIFO: allocs take from the head), counted on the
    ledger's one count of such pops (PageLedger.pops); no tensor is kept (a view would keep its whole
    free_slots alive until the fold). The run moves on to the new free_slots while that still holds
    the run's slots; once a pop reaches them the run ends, keeping the free_slots that holds them,
    and the chain goes on in a new run. Any other alloc (a group's
    slot, handed out from a batch alloc_group_begin took; a pop off a free_slots the probe did not
    see made) queues its slice as it is (SGLang never writes it)."""

    @functools.wraps(original)
    def alloc(self: Any, need_size: int) -> Any:
        before = self.free_slots
        out = original(self, need_size)
        probe = PROBE
        if out is not None and probe.state.active and (probe.hot or _ready()):
            ledger = probe.ledger
            run = ledger.slot_run
            if before is run[1] and self.free_slots is not before:  # NOTE: SGLang's _do_alloc: need_size off the head
                at = ledger.pops
                ledger.pops = at + need_size
                left = run[3] - need_size * run[4]
                if run[2] <= left:
                    run[1], run[3] = self.free_slots, left
                else:
                    run = ledger.slot_run = [self, self.free_slots, 0, left, run[4], run[5]]
                    ledger.slot_runs.append(run)
                probe.pending.extend((ALLOC, self, probe.rid, probe.step, "alloc", at, need_size))
            else:
                probe.pending.extend((ALLOC, self, probe.rid, probe.step, "alloc", out, None))
        return out

    return alloc


def _d_mamba_free(original: Callable[..., Any]) -> Callable[..., Any]:
    """MambaSlotAllocator.free(free_index): the index is often a view SGLang rewrites later (a
    request's slot, a row of the ping-pong buffer), so only what it added is queued (in bytes of
    free_slots: the fold divides by its item size). SGLang's free makes a new free_slots (cat of
    the old one and the index) that it only ever slices from the head (alloc) or replaces (clear):
    the freed slots are its tail. Frees on one allocator whose free_slots chain keep their slots,
    in order, in the tail of the latest free_slots: one run (PageLedger.slot_runs) keeps only that.
    A free chains when its before is exactly the run's free_slots: the last free's after, or what
    a pop the alloc hook saw left of it. Any other before (clear(), alloc_group_begin's pop,
    another allocator's run) starts a new run and a new chain, which begins with that before; the
    old run keeps its free_slots. A fold takes the runs and goes on with the open one as a new chain
    (it begins with the free_slots of now). Here only the new free_slots' size is read (a new run: the
    before's too, and the item size)."""

    @functools.wraps(original)
    def free(self: Any, free_index: Any) -> Any:
        before = self.free_slots
        out = original(self, free_index)
        probe = PROBE
        if probe.state.active and (probe.hot or _ready()):
            after = self.free_slots
            size = after.nbytes
            run = probe.ledger.slot_run
            if before is run[1]:  # NOTE: it holds the run's slots (kept so by the alloc hook): so does after
                freed = size - run[3]
                run[1], run[3] = after, size
                run[2] += freed
            else:
                freed = size - before.nbytes  # NOTE: a new chain: it began with before, at the pops so far
                probe.ledger.slot_run = run = [self, after, freed, size, after.itemsize, (before, probe.ledger.pops)]
                probe.ledger.slot_runs.append(run)
            probe.pending.extend((FREE, self, probe.rid, probe.step, probe.event, freed, None))
        return out

    return free


def _h_swa_init(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(self, *args, **kwargs)
    try:  # NOTE: the sub-allocators are paged / token allocators: their hooks record them, as pool swa
        PROBE.pools[id(self.swa_attn_allocator)] = "swa"
    except Exception as err:
        _failed(err)
    return result


def _in_context(rid: str | None, event: str, call: Callable[[], Any]) -> Any:
    probe = PROBE
    saved = probe.rid, probe.event
    probe.rid, probe.event = rid, event
    try:
        return call()
    finally:
        probe.rid, probe.event = saved


# NOTE: the tree's hot methods are patched directly too (Hook.direct, as the allocators): match,
# insert, evict, lock and unlock run per request and per step, and HookRegistry's AROUND layer cost
# about as much as the hooks' own work. Each factory's method has SGLang's exact parameters (the two
# tree classes differ for lock / unlock and evict_for_alloc); the shared work after SGLang's call is
# in _inserted / _evicted / _locked / _unlocked.


def _matcher(hit_len: Callable[[Any], int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The factory of match_prefix(params) of RadixCache and UnifiedRadixCache: the request's hit and
    asked tokens into the running totals (usage samples), and at level full a match event. `hit_len`:
    the device hit's length read from SGLang's MatchResult (device_prefix_len from 0.5.22; the length of
    its device_indices before)."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def match_prefix(self: Any, params: Any) -> Any:
            probe = PROBE
            req = params.req
            if req is None or not probe.state.active or probe.event == "checkpoint":
                return original(
                    self, params
                )  # NOTE: the cache step's own re-match (0.5.21's names its req) is no query
            rid = req.rid  # NOTE: the match's own; the calls after it are no request's until a hook says so
            result = original(self, params)
            try:
                if probe.hot or _ready():
                    hit, asked = hit_len(result), len(params.key)
                    c = probe.cum
                    c[0] += asked
                    c[1] += hit
                    c[2] += 1
                    if hit:
                        c[3] += 1
                    if probe.emit is not None:
                        event = (probe.step, probe.now, MATCH_V, "full", rid, None, hit, asked - hit, None, None, None)
                        probe.emit(event)
            except Exception as err:
                _failed(err)
            return result

        return match_prefix

    return factory


_d_match = _matcher(operator.attrgetter("device_prefix_len"))
_d_match_indices = _matcher(lambda result: len(result.device_indices))  # NOTE: before 0.5.22


def _d_insert(original: Callable[..., Any]) -> Callable[..., Any]:
    """insert(params) of RadixCache and UnifiedRadixCache."""

    @functools.wraps(original)
    def insert(self: Any, params: Any) -> Any:
        result = original(self, params)
        if PROBE.state.active:
            _inserted(PROBE, params, result)
        return result

    return insert


def _inserted(probe: SglangProbe, params: Any, result: Any) -> None:
    try:
        if not ((probe.hot or _ready()) and probe.emit is not None):
            return
        added = max(len(params.key) - int(result.prefix_len), 0)
        node = _node(result.last_device_node)
        probe.emit((probe.step, probe.now, INSERT_V, "full", probe.rid, node, added, 0, None, None, None))
    except Exception as err:
        _failed(err)


def _d_evict(original: Callable[..., Any]) -> Callable[..., Any]:
    """evict(params) of RadixCache and UnifiedRadixCache: its frees are the evicting request's."""

    @functools.wraps(original)
    def evict(self: Any, params: Any) -> Any:
        probe = PROBE
        if not probe.state.active:
            return original(self, params)
        saved = probe.rid, probe.event
        probe.event = "evict"
        try:
            result = original(self, params)
        finally:
            probe.rid, probe.event = saved
        _evicted(probe, result)
        return result

    return evict


def _d_evict_for_alloc(original: Callable[..., Any]) -> Callable[..., Any]:
    """UnifiedRadixCache.evict_for_alloc(params, *, allocation_reclaim_satisfied)."""

    @functools.wraps(original)
    def evict_for_alloc(self: Any, params: Any, *, allocation_reclaim_satisfied: Any = None) -> Any:
        probe = PROBE
        if not probe.state.active:
            return original(self, params, allocation_reclaim_satisfied=allocation_reclaim_satisfied)
        saved = probe.rid, probe.event
        probe.event = "evict"
        try:
            result = original(self, params, allocation_reclaim_satisfied=allocation_reclaim_satisfied)
        finally:
            probe.rid, probe.event = saved
        _evicted(probe, result)
        return result

    return evict_for_alloc


def _evicted(probe: SglangProbe, result: Any) -> None:
    try:
        if _ready():
            evicted = int(result.num_tokens_evicted)
            probe.cum[4] += evicted
            if probe.emit is not None and evicted:
                swa = int(getattr(result, "swa_num_tokens_evicted", 0))
                event = (probe.step, probe.now, EVICT_V, "full", probe.rid, None, evicted, swa, CAPACITY_V, None, None)
                probe.emit(event)
    except Exception as err:
        _failed(err)


def _d_radix_inc_lock(original: Callable[..., Any]) -> Callable[..., Any]:
    """RadixCache.inc_lock_ref(node): a TreeNode."""

    @functools.wraps(original)
    def inc_lock_ref(self: Any, node: Any) -> Any:
        result = original(self, node)
        if PROBE.state.active:
            _locked(self, node, result)
        return result

    return inc_lock_ref


def _d_radix_dec_lock(original: Callable[..., Any]) -> Callable[..., Any]:
    """RadixCache.dec_lock_ref(node, params=None)."""

    @functools.wraps(original)
    def dec_lock_ref(self: Any, node: Any, params: Any = None) -> Any:
        result = original(self, node, params)
        if PROBE.state.active:
            _unlocked(self, node, result)
        return result

    return dec_lock_ref


def _d_unified_inc_lock(original: Callable[..., Any]) -> Callable[..., Any]:
    """UnifiedRadixCache.inc_lock_ref(node_id, skip_lock_components=()): a NodeId (either core)."""

    @functools.wraps(original)
    def inc_lock_ref(self: Any, node_id: Any, skip_lock_components: Any = ()) -> Any:
        result = original(self, node_id, skip_lock_components)
        if PROBE.state.active:
            _locked(self, node_id, result)
        return result

    return inc_lock_ref


def _d_unified_dec_lock_0519(original: Callable[..., Any]) -> Callable[..., Any]:
    """UnifiedRadixCache.dec_lock_ref(node_id, params=None, skip_swa=False): SGLang 0.5.19 (params made
    required in 0.5.20)."""

    @functools.wraps(original)
    def dec_lock_ref(self: Any, node_id: Any, params: Any = None, skip_swa: bool = False) -> Any:
        result = original(self, node_id, params, skip_swa)
        if PROBE.state.active:
            _unlocked(self, node_id, result)
        return result

    return dec_lock_ref


def _d_unified_dec_lock(original: Callable[..., Any]) -> Callable[..., Any]:
    """UnifiedRadixCache.dec_lock_ref(node_id, params, skip_swa=False)."""

    @functools.wraps(original)
    def dec_lock_ref(self: Any, node_id: Any, params: Any, skip_swa: bool = False) -> Any:
        result = original(self, node_id, params, skip_swa)
        if PROBE.state.active:
            _unlocked(self, node_id, result)
        return result

    return dec_lock_ref


def _locked(tree: Any, node: Any, result: Any) -> None:
    """A lock's ledger entry (node -> its open locks' (rid, step)) and its event; the root's are none."""
    probe = PROBE
    try:
        key = node if type(node) is int else node.id  # NOTE: a NodeId (unified) or a TreeNode (classic)
        root = probe.roots.get(id(tree))
        if key != (_root_of(tree) if root is None else root) and (probe.hot or _ready()):  # NOTE: root id may be 0
            rid, step = probe.rid, probe.step
            held = probe.locks.get(key)
            if held is None:
                probe.locks[key] = [(rid, step)]
            else:
                held.append((rid, step))
            if probe.emit is not None:
                moved = -(getattr(result, "delta", 0) or 0)
                probe.emit((step, probe.now, LOCK_V, "full", rid, key, moved, 0, None, None, None))
    except Exception as err:
        _failed(err)


def _unlocked(tree: Any, node: Any, result: Any) -> None:
    """An unlock ends the open lock of the same request, else the oldest (_drop_holder)."""
    probe = PROBE
    try:
        key = node if type(node) is int else node.id
        root = probe.roots.get(id(tree))
        if key != (_root_of(tree) if root is None else root) and (probe.hot or _ready()):  # NOTE: root id may be 0
            rid = probe.rid
            held = probe.locks.get(key)
            if held:
                if len(held) == 1:
                    del probe.locks[key]
                else:
                    _drop_holder(held, rid)
            if probe.emit is not None:
                moved = getattr(result, "delta", 0) or 0
                probe.emit((probe.step, probe.now, UNLOCK_V, "full", rid, key, moved, 0, None, None, None))
    except Exception as err:
        _failed(err)


def _drop_holder(held: list[tuple[str | None, int]], rid: str | None) -> None:
    """An unlock ends the open lock of the same request, else the oldest (the ledger's holders)."""
    for i, (holder, _) in enumerate(held):
        if holder == rid:
            del held[i]
            return
    del held[0]


def stale_locks(held: list[tuple[str | None, int]], live: set[str], num_live: int) -> list[tuple[str | None, int]]:
    """The open locks on one node beyond the `num_live` its live holders hold (the running requests'
    TreeLock nodes, a streaming session's): SGLang's tree counts locks, not holders, so the count
    decides how many are stale; the live are the live requests' own first, then those taken outside
    any request's call (rid None: the holder was never known), then the oldest."""
    order = sorted(range(len(held)), key=lambda i: (held[i][0] not in live, held[i][0] is not None, i))
    kept = set(order[:num_live])
    return [h for i, h in enumerate(held) if i not in kept]


def _host_hook(kind: str) -> Callable[..., Any]:
    """HiCache component: host eviction, load back, backup (counted as events on pool host)."""

    def hook(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if PROBE.state.active:
            try:
                if _ready() and PROBE.emit is not None:
                    PROBE.emit(
                        (PROBE.step, PROBE.now, kind, "host", PROBE.rid, None, _tokens(result), 0, None, None, None)
                    )
            except Exception as err:
                _failed(err)
        return result

    return hook


def _h_prepare(event: str, kv_of: Callable[[Any], Any] = _KV) -> Callable[..., Any]:
    """ScheduleBatch.prepare_for_`event`: a step begins; after SGLang's own, its requests' row pages are
    bound to them (`kv_of`: the family's reader of a request's KV record)."""

    def hook(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        if not PROBE.state.active:
            return original(self, *args, **kwargs)
        try:
            PROBE.next_step()
        except Exception as err:
            _failed(err)
        result = _in_context(None, event, lambda: original(self, *args, **kwargs))
        try:
            if _ready():
                PROBE.prepared(self.reqs, self.req_to_token_pool, self.tree_cache, event, kv_of)
        except Exception as err:
            _failed(err)
        return result

    return hook


def _h_checkpoint(original: Callable[..., Any], self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """RadixCache / UnifiedRadixCache.checkpoint(req, up_to=...) (0.5.22 on; before, cache_unfinished_req(req,
    chunked)): its insert, re-lock and frees are the request's (SGLang runs it after each prefill chunk,
    outside any other request's call)."""
    if not PROBE.state.active:
        return original(self, req, *args, **kwargs)
    return _in_context(req.rid, "checkpoint", lambda: original(self, req, *args, **kwargs))


def _h_admit(original: Callable[..., Any], self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """PrefillAdder._commit_prefill_admission(req, ...): the prefix lock it takes is the request's."""
    if not PROBE.state.active:
        return original(self, req, *args, **kwargs)
    return _in_context(req.rid, "admit", lambda: original(self, req, *args, **kwargs))


def _h_free_group_end(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """free_group_end: the pages a batch's free group gathered from several requests' calls, released
    at once: no one request's (rid None, event group)."""
    if not PROBE.state.active:
        return original(self, *args, **kwargs)
    return _in_context(None, "group", lambda: original(self, *args, **kwargs))


def _h_release(original: Callable[..., Any], req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> Any:
    if not PROBE.state.active:
        return original(req, tree_cache, *args, **kwargs)
    retracting = PROBE.event == "retract"  # NOTE: retract_decode's release: the request comes back later
    try:
        if not retracting and _ready():
            _record_request(req)
    except Exception as err:
        _failed(err)
    event = "retract" if retracting else "release"
    return _in_context(req.rid, event, lambda: original(req, tree_cache, *args, **kwargs))


def _h_retract(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """ScheduleBatch.retract_decode: each retracted request's release is a retraction (counted on its
    request row, the usage samples' cum_retractions and a retract event), not its end."""
    if not PROBE.state.active:
        return original(self, *args, **kwargs)
    result = _in_context(None, "retract", lambda: original(self, *args, **kwargs))
    try:
        if _ready():
            PROBE.retracted_requests(result[0])
            for req in result[2]:  # NOTE: aborted instead (no room even alone): released here, never again
                _record_request(req)
    except Exception as err:
        _failed(err)
    return result


def _record_request(req: Any, *, unfinished: bool = False) -> None:
    """A request's row, once: at its release (finished, or released unfinished: an abort), or, `unfinished`,
    as the scheduler loop ends with it still holding its row (no finish mark)."""
    rec = PROBE.recorder()
    if rec is None or req.rid in PROBE.recorded:
        return
    PROBE.recorded.add(req.rid)
    prompt = len(req.origin_input_ids)
    record = RequestRecord(
        req.rid,
        None,
        prompt,
        "unfinished" if unfinished else "finished" if req.finished() else "released",
        int(getattr(req, "cached_tokens", 0) or 0),  # NOTE: SGLang's own; prefix_len has moved on to the prompt
        len(req.output_ids),
        PROBE.retractions.pop(req.rid, 0),
    )
    retracted_at = PROBE.retract_marks.pop(req.rid, None)
    if retracted_at is not None:
        record.mark("retract", *retracted_at)
    if not unfinished:
        record.mark("finish", rec.step, _monotonic())
    rec.request(record)
    if PROBE.lean:  # NOTE: no match hook at summary: the totals count each request once, as it is released
        c = PROBE.cum
        c[0] += prompt
        c[1] += record.cached_tokens
        c[2] += 1
        if record.cached_tokens:
            c[3] += 1


def _requests_owning_rows(checker: Any) -> list[Any]:
    """The requests that own a row, as SGLang's invariant checker lists them (0.5.22 on)."""
    return list(checker._requests_owning_rows())


def _batch_owners(checker: Any) -> list[Any]:
    """The requests that own a row, read where SGLang's checker reads them before 0.5.22 had a method for
    it (its uncached count): the last batch's, the running batch's (when another object) and the chunked
    request parked between its chunks, each once, that holds a row."""
    last, running = checker.get_last_batch(), checker.get_running_batch()
    return _holders(last, running, [checker.get_chunked_req()])


def _batch_owners_0519(checker: Any) -> list[Any]:
    """_batch_owners for SGLang 0.5.19, whose checker reaches no chunked request: the one each batch was
    built with (ScheduleBatch.chunked_req, kept on the last batch after SGLang filters the request out of
    its reqs to run the next chunk)."""
    last, running = checker.get_last_batch(), checker.get_running_batch()
    batches = [b for b in (last, running) if b is not None]
    return _holders(last, running, [b.chunked_req for b in batches])


def _batch_owners_0518(checker: Any) -> list[Any]:
    """_batch_owners_0519 for SGLang 0.5.18, whose request holds a row while its own req_pool_idx is set
    (no ReqKvInfo.holds_kv: its ReqKvInfo is None until its first allocation and after its release)."""
    last, running = checker.get_last_batch(), checker.get_running_batch()
    batches = [b for b in (last, running) if b is not None]
    return _holders(last, running, [b.chunked_req for b in batches], _holds_row_0518)


def _holds_kv(req: Any) -> bool:
    return bool(req.kv.holds_kv)


def _holds_row_0518(req: Any) -> bool:
    return req.req_pool_idx is not None


def _holders(last: Any, running: Any, chunked: list[Any], holds: Callable[[Any], bool] = _holds_kv) -> list[Any]:
    """The requests of the last batch, the running batch (when another object) and `chunked`, each once,
    that hold a row (`holds`)."""
    reqs = [] if last is None else list(last.reqs)
    if running is not None and running is not last:  # NOTE: identity: ScheduleBatch's == compares tensors
        reqs += running.reqs
    reqs += [req for req in chunked if req is not None]
    owners: dict[int, Any] = {}
    for req in reqs:
        if holds(req):
            owners.setdefault(id(req), req)
    return list(owners.values())


def _census_hooks(live: LiveReader, busy_point: str = "ingest_requests") -> list[Hook]:
    """The scheduler's and the checker's hooks that run a census (idle, busy, before SGLang raises, as the
    loop ends), each reading the live requests and their locks with the family's `live`; `busy_point`: the
    Scheduler method the normal and overlap loops call first in each iteration (ingest_requests from 0.5.20,
    process_input_requests before)."""

    def on_idle(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = original(self, *args, **kwargs)  # NOTE: SGLang's own check first
        except Exception:  # NOTE: a check SGLang raises from (strict) that no hook below saw: census, then its raise
            _census_before_raise(self.invariant_checker, "SGLang's idle check raised", live)
            PROBE.publish(self)  # NOTE: the checker's own hooks have no metrics collector; the scheduler has
            raise
        if PROBE.state.active and (PROBE.busy or PROBE.pending):
            with guarded(PROBE.state):
                owners = live.owners(self.invariant_checker)
                PROBE.census(self.tree_cache, self.req_to_token_pool, owners, why="idle", live=live)
            PROBE.publish(self)
        return result

    def busy(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        """Scheduler.`busy_point`, first in each iteration of the event loop: before it, the busy census
        when one is due and something moved since the last census (docs/probe.md "When the SGLang probe's
        censuses run": the state here is the one SGLang's own busy check reads)."""
        probe = PROBE
        if probe.in_loop and probe.state.active and (probe.busy or probe.pending) and probe.busy_census_due():
            with guarded(probe.state):
                checker = self.invariant_checker
                owners, rows = live.owners(checker), checker.req_to_token_pool
                probe.census(checker.tree_cache, rows, owners, why="busy", kind="busy", live=live)
            probe.publish(self)
        return original(self, *args, **kwargs)

    def run_event_loop(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        """Scheduler.run_event_loop returns once SGLang's ShutdownReq set gracefully_exit, and raises what
        ended the loop otherwise; run_scheduler_process catches an Exception there, logs it and returns, so
        the process ends normally: the run's end is read here (SglangProbe.end_run), then it goes on."""
        try:
            result = original(self, *args, **kwargs)
        except BaseException as err:
            with suppress(Exception):  # NOTE: never into the engine (end_run guards its own work too)
                PROBE.end_run(self, err, live)
            raise
        with suppress(Exception):
            PROBE.end_run(self, None, live)
        return result

    def report_leak(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        _census_before_raise(self, "SGLang's leak check failed", live)  # NOTE: before "memory leak detected!"
        return original(self, *args, **kwargs)

    def check_req_pool(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        """SGLang's request-row count at an idle point raises (strict) without passing _report_leak."""
        try:
            return original(self, *args, **kwargs)
        except Exception:
            _census_before_raise(self, "SGLang's request-row check failed", live)
            raise

    return [
        Hook(f"{SCHEDULER}.on_idle", on_idle),
        Hook(f"{SCHEDULER}.event_loop_normal", _h_event_loop),
        Hook(f"{SCHEDULER}.event_loop_overlap", _h_event_loop),
        Hook(f"{SCHEDULER}.{busy_point}", busy),
        Hook(f"{SCHEDULER}.run_event_loop", run_event_loop),
        Hook(f"{CHECKER}._report_leak", report_leak),
        Hook(f"{CHECKER}._check_req_pool", check_req_pool),
    ]


def _h_event_loop(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """Scheduler.event_loop_normal / event_loop_overlap: while one runs, busy censuses may run (ingest_requests)."""
    if not PROBE.state.active:
        return original(self, *args, **kwargs)
    saved = PROBE.in_loop
    PROBE.in_loop = True
    try:
        return original(self, *args, **kwargs)
    finally:
        PROBE.in_loop = saved


def _census_before_raise(checker: Any, why: str, live: LiveReader) -> None:
    """The census of an idle point SGLang's check fails at, stored before its error goes on unchanged;
    once per idle point (not again at the step of the last census with nothing moved since)."""
    probe = PROBE
    if probe.state.active and (probe.busy or probe.pending or probe.census_step != probe.step):
        with guarded(probe.state):
            owners = live.owners(checker)
            probe.census(checker.tree_cache, checker.req_to_token_pool, owners, why=why, live=live)


def _lock_nodes(owners: list[Any]) -> list[Any]:
    """The node of each live request's tree lock (Req.lock, a TreeLock, 0.5.22 on; None: it holds none)."""
    return [lock.node for lock in (getattr(req, "lock", None) for req in owners) if lock is not None]


def _last_nodes(owners: list[Any]) -> list[Any]:
    """The node of each live request's tree lock before 0.5.22: its last_node, locked from its admission
    (PrefillAdder._req_inc_lock_ref), moved by cache_unfinished_req, unlocked at its release (unpin)."""
    return [req.last_node for req in owners if req.last_node is not None]


LIVE = LiveReader(_requests_owning_rows, _lock_nodes)
LIVE_0521 = LiveReader(_batch_owners, _last_nodes)  # NOTE: 0.5.20, 0.5.21: no _requests_owning_rows, no Req.lock
LIVE_0519 = LiveReader(_batch_owners_0519, _last_nodes)  # NOTE: no get_chunked_req on the checker
# NOTE: 0.5.18: a request's row and protected length on Req itself; a session slot's lock on its last_node
LIVE_0518 = LiveReader(_batch_owners_0518, _last_nodes, kv_span_0518, session_holders_0518)


def _root_of(tree: Any) -> Any:
    """The tree's root handle, kept per tree (the lock hooks compare a node with it): the node
    (RadixCache) or its id (UnifiedRadixCache, either tree core)."""
    handle = tree.root_node_handle()
    root = PROBE.roots[id(tree)] = handle if isinstance(handle, int) else handle.id
    return root


def _node(node: Any) -> Any:
    return node if isinstance(node, int) else getattr(node, "id", None)


def _tokens(result: Any) -> int:
    return result if isinstance(result, int) else 0


def _pool_hooks(
    rows_alloc: Callable[..., Any] | None = None,
    rows_free: tuple[str, Callable[..., Any]] = ("free_rows", _h_rows_free),
) -> list[Hook]:
    """The allocators' and the request rows' hooks (`rows_alloc`: ReqToTokenPool.alloc's, reading each row
    with the family's reader, _h_rows_alloc when None; `rows_free`: the method that frees rows and its
    hook, free_rows from 0.5.19, free(req) on 0.5.18)."""
    return [
        Hook(f"{PAGED}.alloc", _d_alloc, direct=True, per_op=True),
        Hook(f"{PAGED}.alloc_extend", _d_alloc_extend, direct=True, per_op=True),
        Hook(f"{PAGED}.alloc_decode", _d_alloc_decode, direct=True, per_op=True),
        Hook(f"{PAGED}._release_page_ids", _d_release_pages, direct=True, per_op=True),
        Hook(f"{TOKEN}.alloc", _d_alloc, direct=True, per_op=True),
        Hook(f"{TOKEN}.free", _d_token_free, direct=True, per_op=True),
        Hook(f"{SWA}.__init__", _h_swa_init),
        Hook(f"{ROWS}.alloc", rows_alloc or _h_rows_alloc),
        Hook(f"{ROWS}.{rows_free[0]}", rows_free[1]),
        Hook(f"{MAMBA_SLOTS}.alloc", _d_mamba_alloc, direct=True, per_op=True),
        Hook(f"{MAMBA_SLOTS}.free", _d_mamba_free, direct=True, per_op=True),
    ]


def _tree_hooks(
    match: Callable[..., Any],
    evict_for_alloc: Callable[..., Any] | None,
    host: tuple[tuple[str, str], ...],
    unified_unlock: Callable[..., Any] = _d_unified_dec_lock,
) -> list[Hook]:
    """Both trees' hot methods (`match`: the factory for match_prefix, whose result changed;
    `evict_for_alloc`: for UnifiedRadixCache's, whose keywords changed, None where it has none (0.5.18:
    the allocation path calls evict); `unified_unlock`: for its
    dec_lock_ref, whose params had a default in 0.5.19), and the HiCache component's `host` methods
    ((name, event kind) each)."""
    return [
        Hook(f"{RADIX}.match_prefix", match, direct=True, per_op=True),
        Hook(f"{RADIX}.insert", _d_insert, direct=True, per_op=True),
        Hook(f"{RADIX}.evict", _d_evict, direct=True, per_op=True),
        Hook(f"{RADIX}.inc_lock_ref", _d_radix_inc_lock, direct=True, per_op=True),
        Hook(f"{RADIX}.dec_lock_ref", _d_radix_dec_lock, direct=True, per_op=True),
        Hook(f"{UNIFIED}.match_prefix", match, direct=True, per_op=True),
        Hook(f"{UNIFIED}.insert", _d_insert, direct=True, per_op=True),
        Hook(f"{UNIFIED}.evict", _d_evict, direct=True, per_op=True),
        *(
            []
            if evict_for_alloc is None
            else [Hook(f"{UNIFIED}.evict_for_alloc", evict_for_alloc, direct=True, per_op=True)]
        ),
        Hook(f"{UNIFIED}.inc_lock_ref", _d_unified_inc_lock, direct=True, per_op=True),
        Hook(f"{UNIFIED}.dec_lock_ref", unified_unlock, direct=True, per_op=True),
        *(Hook(f"{UNIFIED}.{name}", _host_hook(kind), per_op=True) for name, kind in host),
    ]


HOST = (("evict_host", HOST_EVICT_V), ("load_back", LOAD_V), ("backup_kv_cache", WRITE_V))


def _request_hooks(prefill_cache: str, admission: str, kv_of: Callable[[Any], Any] = _KV) -> list[Hook]:
    """The calls whose tree and pool work is one request's: both trees' `prefill_cache` method (what caches
    a prefill's tokens: checkpoint from 0.5.22, cache_unfinished_req before), PrefillAdder's `admission`
    (where the prefix lock is taken), release_kv_cache; a free group's end is no request's; the batch's
    prepares bind with `kv_of` (LiveReader)."""
    return [
        Hook(f"{RADIX}.{prefill_cache}", _h_checkpoint, per_op=True),
        Hook(f"{UNIFIED}.{prefill_cache}", _h_checkpoint, per_op=True),
        Hook(f"{ADDER}.{admission}", _h_admit, per_op=True),
        Hook(f"{BASE}.free_group_end", _h_free_group_end, per_op=True),
        Hook(f"{PAGED}.free_group_end", _h_free_group_end, per_op=True),
        Hook(f"{SWA}.free_group_end", _h_free_group_end, per_op=True),
        Hook(f"{BATCH}.prepare_for_extend", _h_prepare("extend", kv_of)),
        Hook(f"{BATCH}.prepare_for_decode", _h_prepare("decode", kv_of)),
        Hook(RELEASE, _h_release),
        Hook(f"{BATCH}.retract_decode", _h_retract),
    ]


def hooks() -> list[Hook]:
    """What the probe hooks in SGLang 0.5.23 (file:line in docs/probe.md). At level summary only the
    batch, request and idle ones (per_op False): the allocators' and the trees' methods stay SGLang's
    own, and the census takes each page's taker from the binds, its locks from the tree's own counts
    (docs/probe.md "Level summary on SGLang")."""
    return [
        *_pool_hooks(),
        *_tree_hooks(_d_match, _d_evict_for_alloc, HOST),
        *_request_hooks("checkpoint", "_commit_prefill_admission"),
        *_census_hooks(LIVE),
    ]


def hooks_0522() -> list[Hook]:
    """SGLang 0.5.22: 0.5.23's hooks, but UnifiedRadixCache.evict_for_alloc takes (self, params) alone
    (0.5.23 added the keyword allocation_reclaim_satisfied): the evict wrapper's parameters."""
    return [
        *_pool_hooks(),
        *_tree_hooks(_d_match, _d_evict, HOST),
        *_request_hooks("checkpoint", "_commit_prefill_admission"),
        *_census_hooks(LIVE),
    ]


def hooks_0521() -> list[Hook]:
    """SGLang 0.5.21: no checkpoint (a prefill's tokens go into the tree through cache_unfinished_req,
    called after each prefill chunk, the request's own) and no _requests_owning_rows on the checker (the
    census's owners come from the scheduler's batches and chunked request: _batch_owners)."""
    return [
        *_pool_hooks(),
        *_tree_hooks(_d_match_indices, _d_evict, HOST),
        *_request_hooks("cache_unfinished_req", "_commit_prefill_admission"),
        *_census_hooks(LIVE_0521),
    ]


def hooks_0520() -> list[Hook]:
    """SGLang 0.5.20: 0.5.21's, but UnifiedRadixCache has no backup_kv_cache (no host-pool retraction
    backup): the HiCache component's host eviction and load back only."""
    return [
        *_pool_hooks(),
        *_tree_hooks(_d_match_indices, _d_evict, HOST[:2]),
        *_request_hooks("cache_unfinished_req", "_commit_prefill_admission"),
        *_census_hooks(LIVE_0521),
    ]


def hooks_0519() -> list[Hook]:
    """SGLang 0.5.19: 0.5.20's, but the admission's prefix lock is taken inside PrefillAdder.add_one_req
    (no _commit_prefill_admission), UnifiedRadixCache.dec_lock_ref's params default to None, the loops call
    process_input_requests first in each iteration (no ingest_requests: the busy census's point), and the
    checker has no get_chunked_req (the census's owners: _batch_owners_0519)."""
    return [
        *_pool_hooks(),
        *_tree_hooks(_d_match_indices, _d_evict, HOST[:2], _d_unified_dec_lock_0519),
        *_request_hooks("cache_unfinished_req", "add_one_req"),
        *_census_hooks(LIVE_0519, "process_input_requests"),
    ]


def hooks_0518() -> list[Hook]:
    """SGLang 0.5.18: 0.5.19's, but ReqToTokenPool frees a request's row with free(req) (no free_rows), the
    row index and the tree's protected length are on Req (ReqKvInfo holds the allocated length only, and is
    None while no KV is held: LIVE_0518's kv_of), and UnifiedRadixCache has no evict_for_alloc (allocation
    evicts through evict, hooked)."""
    return [
        *_pool_hooks(_rows_alloc(kv_span_0518), ("free", _h_rows_free_0518)),
        *_tree_hooks(_d_match_indices, None, HOST[:2], _d_unified_dec_lock_0519),
        *_request_hooks("cache_unfinished_req", "add_one_req", kv_span_0518),
        *_census_hooks(LIVE_0518, "process_input_requests"),
    ]


# NOTE: newest first; a release tested on a family is in its `releases` (docs/probe.md's version table)
FAMILIES: tuple[Family, ...] = (
    _family("0.5.23", ("0.5.23",), hooks),
    _family("0.5.22", ("0.5.22",), hooks_0522),
    _family("0.5.21", ("0.5.21",), hooks_0521, READS_0521),
    _family("0.5.20", ("0.5.20",), hooks_0520, READS_0521),
    _family("0.5.19", ("0.5.19",), hooks_0519, READS_0519),
    _family("0.5.18", ("0.5.18",), hooks_0518, READS_0518),
)


def sglang_version() -> str:
    return installed_version("sglang")


def describe_installed(version: str | None = None, families: tuple[Family, ...] | None = None) -> dict[str, Any]:
    """For `kvscope probe-check`: the installed SGLang's version, the family it loads as (or why none),
    each target's shape and match, and what a capture records (shapes.describe), refused as `_register`
    would refuse it (a directly patched method with one parameter more than the probe's: `_fit`)."""
    version = version or sglang_version()
    families = FAMILIES if families is None else families
    described = describe("SGLang", version, families)
    chosen = next((f for f in families if f.name == described["family"]), None)
    why = None if chosen is None else _fit(version, chosen.build())[1]
    if why is not None:
        described.update(family=None, tested=False, loads=False, line=why)
    described["records"] = PROBE.config(patched=described["loads"])["source"]["provides"]
    return described


def register() -> None:
    """SGLang's general-plugin hook (`load_plugins()`, every SGLang process): register or refuse."""
    register_never_raising(_register)


def _register(version: str | None = None, families: tuple[Family, ...] | None = None) -> str:
    """Register every hook of the family the installed SGLang's code matches, or none; one line says
    what (shapes.choose: a tested release that matches says nothing more; an untested one that matches
    a family says so; any other names the target that differs)."""
    settings = settings_from_env()
    if settings is None:
        return "inert: KVSCOPE_CAPTURE is unset"
    if PROBE.state.active:
        return "already registered in this process"
    version = version or sglang_version()
    PROBE.__init__(settings, version)  # type: ignore[misc]
    if settings.level not in LEVELS:
        return _refuse(f"KVSCOPE_LEVEL must be summary or full, got {settings.level!r}; nothing patched")
    choice = choose("SGLang", version, FAMILIES if families is None else families)
    if choice.family is None:
        return _refuse(choice.line)
    wanted = [h for h in choice.family.build() if not (h.per_op and PROBE.lean)]
    direct, why = _fit(version, wanted)  # NOTE: all made before any is put in place
    if why is not None:
        return _refuse(why)
    around = [h for h in wanted if not h.direct]
    if around:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for h in around:
            HookRegistry.register(h.target, h.hook, HookType.AROUND)
    for owner, name, _, made in direct:
        setattr(owner, name, made)
        PROBE.patched.setdefault(name, {})[owner] = made
    PROBE.state.active = True
    if choice.line:
        say(choice.line)
    family = f"family {choice.family.name}, " if choice.family.name != version else ""
    return f"registered {len(wanted)} hooks on SGLang {version} ({family}level {settings.level})"


def _fit(version: str, wanted: list[Hook]) -> tuple[list[tuple[type, str, Any, Any]], str | None]:
    """Every target of `wanted` resolved and each direct hook's method made: (class, name, SGLang's
    method, the probe's) per direct hook, or the line that refuses them all (a target gone; a direct
    method whose parameters are not exactly SGLang's, though its shape, the leading ones, matched)."""
    missing = [h.target for h in wanted if not (_method_of(h.target) if h.direct else _resolves(h.target))]
    if missing:
        return [], f"SGLang {version}: {', '.join(missing)} not found; nothing patched"
    made = [(h.target, _direct(h)) for h in wanted if h.direct]
    changed = [target for target, (_, _, _, method) in made if method is None]
    if changed:
        return [], f"SGLang {version}: {', '.join(changed)} takes other parameters; nothing patched"
    return [found for _, found in made], None


def _direct(h: Hook) -> tuple[type, str, Callable[..., Any], Callable[..., Any] | None]:
    """(class, name, SGLang's method, the probe's method in its place: None where their parameters
    differ) of a direct hook (its target resolved: _method_of)."""
    found = _method_of(h.target)
    assert found is not None
    owner, name, original = found
    made = h.hook(original)
    theirs, ours = inspect.signature(original), inspect.signature(made, follow_wrapped=False)
    same = [(p.name, p.kind, p.default) for p in theirs.parameters.values()] == [
        (p.name, p.kind, p.default) for p in ours.parameters.values()
    ]
    return owner, name, original, made if same else None


def _method_of(target: str) -> tuple[type, str, Callable[..., Any]] | None:
    """(class, name, the function in the class's own __dict__) of a direct hook's target; None
    where that is not a plain method (a direct hook patches only those)."""
    owner_path, _, name = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError):
        return None
    found = owner.__dict__.get(name) if isinstance(owner, type) else None
    if not callable(found) or isinstance(found, (type, classmethod, staticmethod)):
        return None
    return owner, name, found


def _resolves(target: str) -> bool:
    owner, _, name = target.rpartition(".")
    try:
        obj = pkgutil.resolve_name(owner)
    except (ImportError, AttributeError, ValueError):
        return False
    found = obj.__dict__.get(name) if isinstance(obj, type) else getattr(obj, name, None)
    return callable(found) or isinstance(found, (classmethod, staticmethod))


def _refuse(reason: str) -> str:
    config = PROBE.config(patched=False, reason=reason)
    return refuse(PROBE.state, PROBE.settings, reason, label=f"sglang {PROBE.version} probe (refused)", config=config)
