"""What kvscope's SGLang probe needs of SGLang's code, as shapes (kvscope/probe/shapes.py): the dotted
paths of every target it hooks, the hook table's entry (`Hook`), the attributes each family's census and
hooks read on SGLang's classes (`READS` and its per-release variants) and the shapes a family's hook table
implies (`shapes_of`: each target with the leading parameters its wrapper passes). The families in
sglang_families.py pair these with their hook tables; a release that differs in any of them registers nothing.

NOTE: imports nothing of SGLang: `kvscope probe-check` describes a release's code before it runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from kvscope.probe.shapes import Family, Shape

MEM = "sglang.srt.mem_cache"
PAGED = f"{MEM}.allocator.paged.PagedTokenToKVPoolAllocator"
TOKEN = f"{MEM}.allocator.token.TokenToKVPoolAllocator"
SWA = f"{MEM}.allocator.swa.SWATokenToKVPoolAllocator"
ROWS = f"{MEM}.memory_pool.ReqToTokenPool"
MAMBA_SLOTS = f"{MEM}.allocator.mamba.MambaSlotAllocator"
RADIX = f"{MEM}.radix_cache.RadixCache"
UNIFIED = f"{MEM}.unified_radix_cache.UnifiedRadixCache"
BASE = f"{MEM}.allocator.base.BaseTokenToKVPoolAllocator"
BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
REQ = "sglang.srt.managers.schedule_batch.Req"
ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
RELEASE = f"{MEM}.common.release_kv_cache"


class Hook(NamedTuple):
    """One SGLang target (a dotted path HookRegistry resolves) and its AROUND hook; direct: `hook`
    is a factory, original method -> the method the probe puts on the class itself (no HookRegistry);
    per_op: on an allocator or tree operation (patched at level full only: at summary the census
    reads what those operations left, see `hooks`)."""

    target: str
    hook: Callable[..., Any]
    direct: bool = False
    per_op: bool = False


# NOTE: the classes whose attributes the probe and its census read (sglang_views.py, the hooks in sglang_hooks.py);
# a release that renamed one loads no family (shapes.py: reads). The functions the census calls on
# SGLang's objects are targets of their own (their leading parameters).
READS = (
    Shape(f"{MEM}.memory_pool.ReqToTokenPool", reads=("req_to_token", "free_slots", "size")),
    Shape(PAGED, reads=("page_size", "size", "free_pages")),
    Shape(f"{MEM}.radix_cache.TreeNode", reads=("children", "parent", "key", "value", "lock_ref", "id")),
    Shape(BATCH, reads=("reqs", "req_to_token_pool", "tree_cache")),
    Shape(REQ, reads=("rid", "kv", "origin_input_ids", "output_ids", "cached_tokens")),
    Shape(f"{REQ}KvInfo", reads=("req_pool_idx", "kv_allocated_len", "cache_protected_len", "holds_kv")),
    Shape(SCHEDULER, reads=("invariant_checker", "tree_cache")),
    Shape(CHECKER, reads=("tree_cache", "req_to_token_pool")),
    Shape(f"{CHECKER}._requests_owning_rows", params=("self",)),
    Shape(f"{MEM}.base_prefix_cache.BasePrefixCache.session_records", params=("self",)),
    Shape(f"{UNIFIED}.root_node_handle", params=("self",)),
    Shape(f"{MEM}.base_prefix_cache.MatchResult", reads=("device_prefix_len", "last_device_node")),
    Shape(f"{MEM}.base_prefix_cache.InsertResult", reads=("prefix_len", "last_device_node")),
    Shape(f"{MEM}.base_prefix_cache.EvictResult", reads=("num_tokens_evicted",)),
)
# NOTE: before 0.5.22 the checker has no _requests_owning_rows (_batch_owners reads its batch getters), a
# live request's lock is on its last_node (_last_nodes) and MatchResult holds the device hit's indices
_BEFORE_0522 = {CHECKER, f"{CHECKER}._requests_owning_rows", f"{MEM}.base_prefix_cache.BasePrefixCache.session_records"}
READS_0521 = (
    *(s for s in READS if s.target not in _BEFORE_0522 and not s.target.endswith(".MatchResult")),
    Shape(CHECKER, reads=("tree_cache", "req_to_token_pool", "get_last_batch", "get_running_batch", "get_chunked_req")),
    Shape(REQ, reads=("last_node",)),
    Shape(f"{MEM}.base_prefix_cache.MatchResult", reads=("device_indices", "last_device_node")),
)
READS_0519 = (  # NOTE: the checker without get_chunked_req; the batch's chunked request read instead
    *(s for s in READS_0521 if s.target not in (CHECKER, BATCH, PAGED)),
    Shape(PAGED, reads=("page_size", "size", "free_pages", "release_pages")),  # NOTE: no get_all_free_pages
    Shape(CHECKER, reads=("tree_cache", "req_to_token_pool", "get_last_batch", "get_running_batch")),
    Shape(BATCH, reads=("reqs", "req_to_token_pool", "tree_cache", "chunked_req")),
)

_ROW_0518 = ("req_pool_idx", "cache_protected_len")
_SLOT_0518 = (*_ROW_0518, "kv", "last_node", "is_holding_kv")  # NOTE: a streaming session's record between turns
READS_0518 = (  # NOTE: the row and the protected length on Req, the allocated length alone on ReqKvInfo
    *(s for s in READS_0519 if s.target not in (REQ, f"{REQ}KvInfo")),
    Shape(REQ, reads=("rid", "kv", "origin_input_ids", "output_ids", "cached_tokens", "last_node", *_ROW_0518)),
    Shape(f"{REQ}KvInfo", reads=("kv_allocated_len",)),
    Shape("sglang.srt.session.streaming_session.SessionSlot", reads=_SLOT_0518),
)


def shapes_of(table: list[Hook], reads: tuple[Shape, ...] = READS) -> tuple[Shape, ...]:
    """Each hook's target with the leading parameters its wrapper passes (a direct hook: every one of
    its method's), then the classes read."""
    return (*(Shape(h.target, params=_params_of(h)) for h in table), *reads)


def _params_of(h: Hook) -> tuple[str, ...]:
    """The parameter names a hook relies on: a direct hook's method's (made from a stand-in method);
    an AROUND hook's, after `original` up to its *args."""
    if h.direct:
        made = h.hook(_stand_in)
        return tuple(inspect.signature(made, follow_wrapped=False).parameters)
    names = []
    for p in list(inspect.signature(h.hook).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


def _stand_in(*args: Any, **kwargs: Any) -> None:
    """What a direct hook's factory wraps when only its method's parameters are asked for."""


def _family(
    name: str, releases: tuple[str, ...], build: Callable[[], list[Hook]], reads: tuple[Shape, ...] = READS
) -> Family:
    return Family(name, releases, shapes_of(build(), reads), build)
