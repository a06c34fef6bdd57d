"""The SGLang probe's families: per release line, which hook (sglang_hooks.py) goes on which target
(sglang_shapes.py), with the reader of its live requests (sglang_live.py); FAMILIES, newest first, is
what sglang.py registers from (shapes.choose)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.probe.sglang_hooks import (
    HOST_EVICT_V,
    LOAD_V,
    WRITE_V,
    _census_hooks,
    _d_alloc,
    _d_alloc_decode,
    _d_alloc_extend,
    _d_evict,
    _d_evict_for_alloc,
    _d_insert,
    _d_mamba_alloc,
    _d_mamba_free,
    _d_match,
    _d_match_indices,
    _d_radix_dec_lock,
    _d_radix_inc_lock,
    _d_release_pages,
    _d_token_free,
    _d_unified_dec_lock,
    _d_unified_dec_lock_0519,
    _d_unified_inc_lock,
    _h_admit,
    _h_checkpoint,
    _h_free_group_end,
    _h_prepare,
    _h_release,
    _h_retract,
    _h_rows_alloc,
    _h_rows_free,
    _h_rows_free_0518,
    _h_swa_init,
    _host_hook,
    _rows_alloc,
)
from kvscope.probe.sglang_live import _KV, LIVE, LIVE_0518, LIVE_0519, LIVE_0521
from kvscope.probe.sglang_shapes import (
    ADDER,
    BASE,
    BATCH,
    MAMBA_SLOTS,
    PAGED,
    RADIX,
    READS_0518,
    READS_0519,
    READS_0521,
    RELEASE,
    ROWS,
    SWA,
    TOKEN,
    UNIFIED,
    Hook,
    _family,
)
from kvscope.probe.sglang_views import kv_span_0518
from kvscope.probe.shapes import Family


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
