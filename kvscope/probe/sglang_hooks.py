"""The SGLang probe's hooks: the methods put on SGLang's allocators, request-row pool, radix trees,
HiCache component, batches and scheduler (each calls SGLang's own exactly as SGLang did), feeding the one
probe of this process, PROBE (sglang_probe.SglangProbe), and the hooks that run its census. Which hook goes
on which target, per family, is in sglang_families.py; registering them in sglang.py.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from kvscope.probe.core import error_line, guarded
from kvscope.probe.sglang_ledger import ALLOC, FREE
from kvscope.probe.sglang_live import _KV, LiveReader
from kvscope.probe.sglang_probe import SglangProbe, _node
from kvscope.probe.sglang_shapes import CHECKER, SCHEDULER, Hook
from kvscope.telemetry import EventKind, EvictReason

MATCH_V, INSERT_V, LOCK_V, UNLOCK_V, EVICT_V = (
    k._value_ for k in (EventKind.MATCH, EventKind.INSERT, EventKind.LOCK, EventKind.UNLOCK, EventKind.EVICT)
)
HOST_EVICT_V, LOAD_V, WRITE_V = (k._value_ for k in (EventKind.HOST_EVICT, EventKind.LOAD, EventKind.WRITE))
CAPACITY_V = EvictReason.CAPACITY._value_

# -- the hooks (SGLang's AROUND form: hook(original, *args, **kwargs)) --------------------------------
# NOTE: each calls the original exactly as SGLang did; kvscope's part runs only while recording and
# its first exception stops recording (one line) without reaching SGLang.

PROBE = SglangProbe(None, "")


def _failed(err: Exception) -> None:
    PROBE.state.stop(error_line(err))


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
            PROBE.record_request(req)
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
                PROBE.record_request(req)
    except Exception as err:
        _failed(err)
    return result


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


def _root_of(tree: Any) -> Any:
    """The tree's root handle, kept per tree (the lock hooks compare a node with it): the node
    (RadixCache) or its id (UnifiedRadixCache, either tree core)."""
    handle = tree.root_node_handle()
    root = PROBE.roots[id(tree)] = handle if isinstance(handle, int) else handle.id
    return root


def _tokens(result: Any) -> int:
    return result if isinstance(result, int) else 0
