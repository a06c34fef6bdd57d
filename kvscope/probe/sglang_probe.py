"""The SGLang probe's state in one process (SglangProbe): its recorder, whom the pools work for, the page
and lock ledgers, the per-step usage samples and tree snapshots, the binds of each batch's row pages, the
request records, and the census (at each idle point, periodically while busy and as the scheduler loop
ends; its rules in sglang_census.py, what it reads in sglang_views.py and sglang_live.py). The hooks that
feed it are in sglang_hooks.py; the families and their registration in sglang_families.py and sglang.py.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any

from kvscope.probe.core import (
    CENSUS_BUDGET_X,
    LAST_CENSUS,
    ProbeState,
    Settings,
    busy_census_due,
    census_clock,
    engine_ending,
    guarded,
    process_recorder,
    say,
)
from kvscope.probe.metrics import CensusTally
from kvscope.probe.sglang_census import census_blocks, census_checks, census_line, take_page_census, violation
from kvscope.probe.sglang_ledger import BIND, PageLedger, _gather
from kvscope.probe.sglang_live import _KV, LIVE, LiveReader
from kvscope.probe.sglang_metrics import SglangMetrics, page_terms
from kvscope.probe.sglang_views import (
    Holder,
    live_pages,
    mamba_allocator,
    mamba_view,
    page_view,
    row_view,
    stale_locked_pages,
    swa_pool,
    swa_view,
    tree_rows,
    tree_slots,
)
from kvscope.telemetry import EventKind, PoolTerms, RequestRecord, UsageSample
from kvscope.telemetry.remote import signals_held

ENGINE = "sglang"
RETRACT_V = EventKind.REQUEST_RETRACT._value_

TREE_METHODS = ("match_prefix", "insert", "evict", "inc_lock_ref", "dec_lock_ref")  # NOTE: patched at level full

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
        recording, why = self.state.recording()
        with suppress(Exception):  # NOTE: the metrics are the engine's; a failure here is not the engine's
            self.metrics.publish(scheduler, self.tally, recording, why)

    # -- the recorder ---------------------------------------------------------------------------

    def recorder(self) -> Any:
        """This process's recorder, opened at its first event; None once recording stopped."""
        return process_recorder(self, ENGINE)

    def unwire(self) -> None:
        self.hot, self.emit, self.emit_block = False, None, None
        self.dp_rank = _dp_rank()  # NOTE: the run's label names it: a spawned scheduler knows its own

    def wire(self, rec: Any) -> None:
        self.step = rec.step
        self.emit = rec.item_sink() if rec.enabled else None
        self.emit_block = rec.event_block if rec.enabled else None
        self.hot = True
        atexit.register(self.drain_at_exit)  # NOTE: after the recorder's own: runs before its close
        multiprocessing.util.Finalize(None, self.drain_at_exit, exitpriority=101)  # NOTE: a spawned scheduler

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
        self.record_usage(rec, terms, running, total - available)

    def record_usage(self, rec: Any, terms: PoolTerms, running: int, full_used: int) -> None:
        """The step's usage sample: `terms` and the running count beside the probe's cumulative
        counters (prompt, hit, requests, ... in self.cum); one per step (usage_step)."""
        c = self.cum
        rec.usage(
            UsageSample(
                rec.step, terms, None, 0, 0, running, 0, c[0], c[1], c[2], c[3], c[4], c[5], full_used=full_used
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

    def record_request(self, req: Any, *, unfinished: bool = False) -> None:
        """A request's row, once: at its release (finished, or released unfinished: an abort), or, `unfinished`,
        as the scheduler loop ends with it still holding its row (no finish mark)."""
        rec = self.recorder()
        if rec is None or req.rid in self.recorded:
            return
        self.recorded.add(req.rid)
        prompt = len(req.origin_input_ids)
        record = RequestRecord(
            req.rid,
            None,
            prompt,
            "unfinished" if unfinished else "finished" if req.finished() else "released",
            int(getattr(req, "cached_tokens", 0) or 0),  # NOTE: SGLang's own; prefix_len has moved on to the prompt
            len(req.output_ids),
            self.retractions.pop(req.rid, 0),
        )
        retracted_at = self.retract_marks.pop(req.rid, None)
        if retracted_at is not None:
            record.mark("retract", *retracted_at)
        if not unfinished:
            record.mark("finish", rec.step, _monotonic())
        rec.request(record)
        if self.lean:  # NOTE: no match hook at summary: the totals count each request once, as it is released
            c = self.cum
            c[0] += prompt
            c[1] += record.cached_tokens
            c[2] += 1
            if record.cached_tokens:
                c[3] += 1

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
                        self.record_request(req, unfinished=True)
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
            frees_seen=not self.lean,  # NOTE: the rows' frees are hooked at both levels, the pools' at full only
        )
        results = [result]
        swa = swa_pool(allocator)
        if swa is not None:
            swa_pages = swa_view(allocator, swa, in_tree, rows, owners)
            swa_takers, swa_releasers = self.takers["swa"], self.releasers["swa"]
            results.append(take_page_census("swa", swa_pages, swa_takers, swa_releasers, {}, frees_seen=not self.lean))
        row_result = take_page_census("req", row_view(rows, owners), self.takers["req"], self.releasers["req"], {})
        results.append(row_result)
        slots = mamba_allocator(rows)
        if slots is not None:
            takers, releasers = self.takers["mamba"].get(id(slots), {}), self.releasers["mamba"].get(id(slots), {})
            mamba_pages = mamba_view(tree, rows, slots, owners)
            results.append(take_page_census("mamba", mamba_pages, takers, releasers, {}, frees_seen=not self.lean))
        for check in census_checks(rec.step, results, kind):
            rec.leak_check(check)
        rec.census_blocks(census_blocks(rec.step, results))
        self.tally.note_counts(rec.step, page_terms(results), kind)
        ps = view.page_size
        used = (view.num_pages - len(result.free)) * ps
        terms = PoolTerms(view.num_pages * ps, len(result.free) * ps, len(result.tree - result.live) * ps, 0)
        if self.usage_step != rec.step:
            self.record_usage(rec, terms, len(owners), used)
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


def stale_locks(held: list[tuple[str | None, int]], live: set[str], num_live: int) -> list[tuple[str | None, int]]:
    """The open locks on one node beyond the `num_live` its live holders hold (the running requests'
    TreeLock nodes, a streaming session's): SGLang's tree counts locks, not holders, so the count
    decides how many are stale; the live are the live requests' own first, then those taken outside
    any request's call (rid None: the holder was never known), then the oldest."""
    order = sorted(range(len(held)), key=lambda i: (held[i][0] not in live, held[i][0] is not None, i))
    kept = set(order[:num_live])
    return [h for i, h in enumerate(held) if i not in kept]


def _node(node: Any) -> Any:
    return node if isinstance(node, int) else getattr(node, "id", None)
