"""The probe inside SGLang's scheduler process: hooks on the allocators, the request-row pool and the
radix trees of the code families in FAMILIES (shapes.py), registered through SGLang's own plugin framework
(HookRegistry, AROUND hooks; the allocators' and the trees' hot methods patched directly, see `_register`), and the
page census (sglang_census.py) at each idle point, periodically while busy and as the scheduler loop ends.
This module registers them; the parts live beside it:
    sglang_probe.py     the probe's state in one process (SglangProbe): recorder, ledgers, usage, census
    sglang_hooks.py     the hooks, reaching that state through their module's PROBE
    sglang_families.py  per release line, which hook goes on which target (FAMILIES)
    sglang_live.py      how each family reads the scheduler's live requests (LIVE, LIVE_05xx)
    sglang_ledger.py    the page ledger (Mamba slots included)
    sglang_views.py     what a census and a snapshot read of SGLang's pools and trees
    sglang_shapes.py    the targets and the shapes of SGLang's code each family expects

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

import inspect
import os
import pkgutil
from collections.abc import Callable
from typing import Any

from kvscope.probe.core import (
    DEFAULT_LEVEL,
    LEVELS,
    installed_version,
    refuse,
    register_never_raising,
    say,
    settings_from_env,
)
from kvscope.probe.sglang_families import (
    FAMILIES,
    HOST,
    hooks,
    hooks_0518,
    hooks_0519,
    hooks_0520,
    hooks_0521,
    hooks_0522,
)
from kvscope.probe.sglang_hooks import PROBE
from kvscope.probe.sglang_live import LIVE, LIVE_0518, LIVE_0519, LIVE_0521, LiveReader
from kvscope.probe.sglang_probe import SNAPSHOT_EVERY_STEPS, SglangProbe, stale_locks
from kvscope.probe.sglang_shapes import (
    ADDER,
    MAMBA_SLOTS,
    PAGED,
    RADIX,
    RELEASE,
    ROWS,
    SCHEDULER,
    UNIFIED,
    Hook,
)
from kvscope.probe.shapes import Family, choose, describe

__all__ = [  # NOTE: the names drivers and tests reach through this module; private helpers: their own modules
    "ADDER",
    "FAMILIES",
    "HOST",
    "LIVE",
    "LIVE_0518",
    "LIVE_0519",
    "LIVE_0521",
    "MAMBA_SLOTS",
    "PAGED",
    "PROBE",
    "RADIX",
    "RELEASE",
    "ROWS",
    "SCHEDULER",
    "SNAPSHOT_EVERY_STEPS",
    "UNIFIED",
    "Hook",
    "LiveReader",
    "SglangProbe",
    "describe_installed",
    "hooks",
    "hooks_0518",
    "hooks_0519",
    "hooks_0520",
    "hooks_0521",
    "hooks_0522",
    "register",
    "sglang_version",
    "stale_locks",
]


def sglang_version() -> str:
    return installed_version("sglang")


def describe_installed(version: str | None = None, families: tuple[Family, ...] | None = None) -> dict[str, Any]:
    """For `kvscope probe-check`: the installed SGLang's version, the family it loads as (or why none),
    each target's shape and match, and what a capture records (shapes.describe), refused as `_register`
    would refuse it at the level it would run at (KVSCOPE_LEVEL, else SGLang's default): a directly patched
    method with one parameter more than the probe's (`_fit`), at summary only those it patches."""
    version = version or sglang_version()
    families = FAMILIES if families is None else families
    described = describe("SGLang", version, families)
    chosen = next((f for f in families if f.name == described["family"]), None)
    lean = (os.environ.get("KVSCOPE_LEVEL", "").strip() or DEFAULT_LEVEL["sglang"]) == "summary"
    why = None if chosen is None else _fit(version, [h for h in chosen.build() if not (h.per_op and lean)])[1]
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
    settings = settings_from_env(engine="sglang")
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
