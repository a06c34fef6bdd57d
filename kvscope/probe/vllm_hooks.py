"""The vLLM probe's wrappers: the methods put on vLLM's block pool, free queue, KV-cache managers,
scheduler and EngineCore (each calls vLLM's own exactly as vLLM did), feeding the one probe of this
process, PROBE (vllm_probe.VllmProbe). Which wrapper goes on which target, per family, is in
vllm_families.py; patching them in vllm.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from kvscope.probe.core import LAST_CENSUS, error_line, guarded
from kvscope.probe.core import engine_ending as core_engine_ending
from kvscope.probe.vllm_probe import (
    ALLOC_V,
    EVICT_V,
    FREE_V,
    FULL,
    FULL_V,
    LOCK_V,
    NO_ROOM_V,
    REVIVE_V,
    UNLOCK_V,
    VllmProbe,
    _monotonic,
    _monotonic_ns,
)
from kvscope.telemetry import EventKind, EvictReason, LookupStop
from kvscope.telemetry.exits import ExitStatus
from kvscope.telemetry.remote import signals_held

# -- the wrappers ---------------------------------------------------------------------------------
# NOTE: each calls the original exactly as vLLM did; kvscope's part runs only while recording is
# active and under `guarded`. Around-wrappers that set the context restore it in `finally`.

PROBE = VllmProbe(None, "")
os.register_at_fork(after_in_child=lambda: PROBE.forked())


def _failed(err: Exception) -> None:
    """kvscope's part of a hot wrapper raised: recording stops (one line); the engine never sees it."""
    PROBE.state.stop(error_line(err))


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
                PROBE.record_request(request)
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
            PROBE.record_request(request)
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
