"""The vLLM probe's state in one process (VllmProbe): its recorder and event stream, the context (whom the
block pool works for), the ledger of takers and releasers kept at summary, the per-step usage samples and
tree snapshots, the request records, and the block census (census.py) between engine steps: at each
busy -> idle edge, periodically while busy, at a live poll, and at the drain as the engine shuts down; what
it reads of the pool is in vllm_views.py. The wrappers that feed it are in vllm_hooks.py; the families and
their registration in vllm_families.py and vllm.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvscope.probe.census import TERMS, CensusResult, census_blocks, census_checks, named, take_census
from kvscope.probe.core import (
    CENSUS_BUDGET_X,
    ProbeState,
    Settings,
    busy_census_due,
    census_clock,
    process_recorder,
)
from kvscope.probe.metrics import CensusTally
from kvscope.probe.vllm_views import block_view, tree_rows
from kvscope.telemetry import EventKind, PoolName, PoolTerms, RequestRecord, RequestStatus, UsageSample
from kvscope.telemetry.exits import ExitStatus
from kvscope.telemetry.remote import CLOCK, EventStream, RemoteRecorder

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

PROVIDES = ("blocks", "ownership", "refs", "leak_checks", "requests", "tree")


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
        return process_recorder(self, ENGINE)

    def unwire(self) -> None:
        self.hot, self.emit, self.stream = False, None, None

    def wire(self, rec: Any) -> None:
        self.step = rec.step
        if rec.enabled:
            self.stream = stream = rec.event_stream()
            stream.slot_ids = _block_ids  # NOTE: the wrappers append the blocks themselves
            self.emit, self.slot_buf = stream.records.extend, stream.slots
        self.hot = True

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
            self.record_request(request, unfinished=True)
        return result

    def record_request(self, request: Any, *, unfinished: bool = False) -> None:
        """A request's row, once: when it has finished (or, `unfinished`, as the engine shuts down with it
        still running or waiting: no finish mark)."""
        rec = self.recorder()
        rid = request.request_id
        if rec is None or rid in self.recorded_rids or request.is_finished() == unfinished:
            return
        self.recorded_rids.add(rid)
        prompt_len, hit = self.lookups.pop(rid, (int(request.num_prompt_tokens), 0))
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
        seen = self.seen.pop(rid, None)
        if seen is not None:  # NOTE: vLLM's arrival is wall-clock; the step is the one of its first lookup
            record.mark("arrive", seen[0], min(seen[1], float(request.arrival_time) - time.time() + now))
        for moment, mark in (("admit", self.admitted.pop(rid, None)), ("retract", self.retracted.pop(rid, None))):
            if mark is not None:
                record.mark(moment, *mark)
        if unfinished:
            rec.request(record)
            return
        record.mark("finish", rec.step, now)
        rec.request(record)
        if self.stream is not None:
            reason = request.get_finished_reason()
            self.stream.event(
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
