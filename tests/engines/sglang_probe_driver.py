"""Drives the probe against SGLang 0.5.23's real memory classes in one process (no server: SGLang
has no CPU build of its kernels). Run with the SGLang venv's python, the repository on PYTHONPATH:

    python sglang_probe_driver.py SCENARIO [TREE]

TREE: unified (UnifiedRadixCache, Python tree core), rust (the same, Rust tree core), classic
(RadixCache), overriding (a RadixCache subclass overriding inc_lock_ref: OverridingRadixCache),
swa (UnifiedRadixCache with its SWA component, Python tree core, over SGLang's
SWATokenToKVPoolAllocator and SWAKVPool: a full and an swa pool), mamba (UnifiedRadixCache with its
Mamba component, Python tree core, over SGLang's HybridReqToTokenPool with a MambaPool of MAMBA_SLOTS
slots from a tiny Mamba2 state shape, and a TokenToKVPoolAllocator: page size 1, as the Mamba
component requires without the extra buffer), mamba-buffer (the same with SGLang's Mamba extra buffer:
ping-pong track slots, page size 4 on the paged allocator; its state tracking is not driven).
SCENARIO: clean, shared (clean; the request running across the idle point holds a lock on the
shared prefix), leak-tail, lock-leak, double-free, double-free-reused (the freed page
handed to req-D's row while the tree keeps it), double-free-in-tree (then req-D's release puts it in
a second tree node), row-leak (req-A's row never freed: SGLang's strict _check_req_pool raises in its real
Scheduler.on_idle, run on a stand-in scheduler: Engine.on_idle), row-leak-unhooked (the same without
the probe's hook on _check_req_pool), group-double-free (a tree page freed again in a free group),
batch-lock-leak (two requests in one prefill batch, SGLang's checkpoint_kv_cache after it; the first
one's lock leaks), retract (SGLang's retract_decode on a decode batch of two), leak-and-double-free,
swa-leak (swa only),
mamba-leak, mamba-double-free (mamba only; clean runs on mamba-buffer too), session, session-close,
session-lock-leak (a streaming session's turns; unified), dp (clean, as a DP replica's scheduler),
untested-release (no family lists the release as tested), missing-target, changed-parameters,
changed-tree-parameters, changed-mamba-parameters (a changed shape), changed-trailing-parameters (a direct
hook's method one parameter short of SGLang's; EDITS). SGLang's release is the one first on the path
(PYTHONPATH names an unpacked release's source before the venv's 0.5.23).
The environment names the capture (KVSCOPE_CAPTURE, KVSCOPE_PYTHON; `kvscope instrument` sets both).
SGLang's own load_plugins() installs the probe.

The request life is the scheduler's, on SGLang's real objects: Req.init_next_round_input (match
through match_kv_cache) -> tree.lock -> ReqToTokenPool.alloc -> (evict under pressure) ->
PagedTokenToKVPoolAllocator.alloc_extend (chunked prefill: two chunks into one row) -> row write ->
alloc_decode page by page -> release_kv_cache (checkpoint into the tree, free the row's tail, unlock,
free the row). What the probe's prepare_for_extend / prepare_for_decode hooks do after SGLang's
own (bind a request's row pages to it) is called here directly: ScheduleBatch needs a model runner.
The idle point runs SGLang's own SchedulerInvariantChecker count identity, then its _report_leak
(strict: it raises ValueError, as in a server) when the identity fails, then (no request running) its
_check_req_pool (strict: raises on a row count off), then, when nothing raised, the probe's census.
Prints one JSON line: what the probe said, SGLang's identity per idle point, the censuses, the
injected ground truth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engines.sglang_standins import install

install()
os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")

import torch  # noqa: E402
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers import schedule_policy  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ReqKvInfo, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import PrefillAdder  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler_components import pool_stats_observer  # noqa: E402
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker  # noqa: E402
from sglang.srt.mem_cache import common  # noqa: E402
from sglang.srt.mem_cache.allocator import paged  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.session.session_controller import Session  # noqa: E402

from kvscope.probe import sglang as probe  # noqa: E402
from kvscope.probe import sglang_hooks, sglang_probe, sglang_shapes  # noqa: E402

# NOTE: _commit_prefill_admission (and its _PrefillAdmission) came with 0.5.20; 0.5.19 locks inside add_one_req
ADMISSION = getattr(schedule_policy, "_PrefillAdmission", None)
ADMISSION_FIELDS = 0 if ADMISSION is None else len(dataclasses.fields(ADMISSION))  # NOTE: 0.5.23 added replay_len
# NOTE: the trees' checkpoint came with 0.5.22, as did Req.prefix_len, Req.lock (a TreeLock) and
# release_kv_cache's checkpoint keyword; before, a request holds its match in prefix_indices, its lock on
# last_node (lock_receipt), release_kv_cache takes is_insert, and a prefill's tokens are cached through
# cache_unfinished_req (SGLang 0.5.21's batch_result_processor: after each prefill of a request that goes on)
CHECKPOINT = hasattr(RadixCache, "checkpoint")
# NOTE: the family's reading of the live requests and their locks (the checker's get_chunked_req from 0.5.20)
CHUNKED_GETTER = "get_chunked_req" in {f.name for f in dataclasses.fields(SchedulerInvariantChecker)}
# NOTE: 0.5.18 keeps a request's row and protected length on Req, its allocated length on a ReqKvInfo made at
# its first allocation (alloc_for_extend) and dropped at its release; its committed length on Req too
ROW_ON_REQ = "req_pool_idx" not in {f.name for f in dataclasses.fields(ReqKvInfo)}
LIVE = (
    probe.LIVE
    if CHECKPOINT
    else probe.LIVE_0521
    if CHUNKED_GETTER
    else probe.LIVE_0518
    if ROW_ON_REQ
    else probe.LIVE_0519
)
KV_OF = LIVE.kv_of  # NOTE: a request -> its KV record (row, protected and allocated lengths), as the family reads it
DP_RANK = None  # the data-parallel rank published for the process: scenario dp (replica 1)
PS = 4  # tokens per page
PAGES = 16
ROWS = 8
CONTEXT = 64
WINDOW = 8  # tokens: the SWA component's sliding window (tree swa)
MAMBA_SLOTS = 4  # Mamba state slots (tree mamba: page size 1 and PAGES tokens; mamba-buffer: 8; set by configure)


def configure(tree_kind: str) -> None:
    """Page size 1 for the Mamba component (64 pages of one token), 4 otherwise (16 pages)."""
    global PS, PAGES, MAMBA_SLOTS
    if tree_kind == "mamba":
        PS, PAGES = 1, 64
    elif tree_kind == "mamba-buffer":  # NOTE: 3 slots per request: its state and two ping-pong track slots
        MAMBA_SLOTS = 8


class OverridingRadixCache(RadixCache):
    """A tree class that overrides a method the probe patched on RadixCache, as SGLang 0.5.18's HiRadixCache
    (what --enable-hierarchical-cache builds for a plain model) overrides its match, insert, evict and locks."""

    def inc_lock_ref(self, node: Any) -> Any:
        return super().inc_lock_ref(node)


class Engine:
    """SGLang's pools and tree, and the requests the scheduler would hold."""

    def __init__(self, tree_kind: str) -> None:
        self.swa = tree_kind == "swa"
        self.mamba = tree_kind.startswith("mamba")
        self.buffer = tree_kind == "mamba-buffer"
        if self.swa:  # NOTE: SGLang's SWA KV pool on the CPU (tiny buffers: one full and one SWA layer)
            kv = SWAKVPool(PAGES * PS, PAGES * PS, PS, torch.float32, 1, 4, [0], [1], "cpu")
            self.alloc: Any = SWATokenToKVPoolAllocator(PAGES * PS, PAGES * PS, PS, torch.int64, "cpu", kv, False)
        elif PS == 1:  # NOTE: SGLang's token allocator
            self.alloc = TokenToKVPoolAllocator(PAGES * PS, torch.int64, "cpu", None, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(PAGES * PS, PS, torch.int64, "cpu", None, False)
        self.rows: Any = mamba_rows(self.buffer) if self.mamba else ReqToTokenPool(ROWS, CONTEXT, "cpu", False)
        if tree_kind in ("classic", "overriding"):
            params = CacheInitParams(
                disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc, page_size=PS
            )
            self.tree: Any = (OverridingRadixCache if tree_kind == "overriding" else RadixCache)(params)
        else:
            extra = ComponentType.SWA if self.swa else ComponentType.MAMBA if self.mamba else None
            params = fitted(  # NOTE: tree_core_backend from 0.5.21 (the Rust core); asked of 0.5.20, core() says
                CacheInitParams,
                disable=False,
                req_to_token_pool=self.rows,
                token_to_kv_pool_allocator=self.alloc,
                page_size=PS,
                tree_components=(ComponentType.FULL,) if extra is None else (ComponentType.FULL, extra),
                sliding_window_size=WINDOW if self.swa else None,
                tree_core_backend="rust" if tree_kind == "rust" else "python",
                enable_mamba_extra_buffer=self.buffer,
            )
            self.tree = UnifiedRadixCache(params)
        self.live: dict[str, Req] = {}
        self.checker = fitted(
            SchedulerInvariantChecker,
            is_hybrid_swa=self.swa,
            is_hybrid_ssm=self.mamba,
            disaggregation_mode=None,
            page_size=PS,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=PAGES * PS if self.swa else None,
            max_total_num_tokens=PAGES * PS,
            tree_cache=self.tree,
            token_to_kv_pool_allocator=self.alloc,
            req_to_token_pool=self.rows,
            pool_stats_observer=fitted(
                pool_stats_observer.SchedulerPoolStatsObserver,
                tree_cache=self.tree,
                token_to_kv_pool_allocator=self.alloc,
                req_to_token_pool=self.rows,
                session_controller=None,
                hisparse_coordinator=None,
                is_hybrid_swa=self.swa,
                is_hybrid_ssm=self.mamba,
                enable_hisparse=False,
                full_tokens_per_layer=None,
                swa_tokens_per_layer=PAGES * PS if self.swa else None,
                max_total_num_tokens=PAGES * PS,
                get_last_batch=self.last_batch,
                get_running_batch=lambda: None,
            ),
            get_last_batch=self.last_batch,
            get_running_batch=lambda: None,
            scheduler_stage_metrics=None,
        )

    def last_batch(self) -> Any:
        """The scheduler's last batch as SGLang's checker reads it: the live requests."""
        return SimpleNamespace(reqs=list(self.live.values()), is_empty=lambda: not self.live, chunked_req=None)

    def owners(self) -> list[Req]:
        """The live requests that own a row: SGLang's own list (0.5.22 on), else the probe's reading of
        the checker's batches (what its family's census hooks read)."""
        if CHECKPOINT:
            return list(self.checker._requests_owning_rows())
        return LIVE.owners(self.checker)

    def session_held(self) -> int:
        """The tokens SGLang's pool stats count as a streaming session's (none without a session)."""
        if not CHECKPOINT:
            return int(self.checker.pool_stats_observer.session_held_tokens())
        records = self.tree.session_records().values()  # NOTE: SGLang's pool stats: a session's private pages
        return sum(pool_stats_observer.kv_private_tokens(kv, PS) for kv in records if kv.holds_kv)

    def core(self) -> str:
        return type(getattr(self.tree, "tree_core", self.tree)).__name__

    # -- the scheduler's request life -----------------------------------------------------------

    def admit(self, rid: str, tokens: list[int], *, chunk: int | None = None, session: Any = None) -> Req:
        """Prefill: match, lock, row, (evict), alloc_extend per chunk, row write, bind. `session`: a
        streaming session's turn (its first turn's record and lock go to the session at its row's
        first allocation; a later turn borrows them)."""
        req = self.arrive(rid, tokens, session)
        self.commit(req)
        self.take_row(req, tokens, chunk)
        return req

    def arrive(self, rid: str, tokens: list[int], session: Any = None) -> Req:
        """A waiting request's match (the scheduler matches its waiting queue before it admits any)."""
        req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=16))
        req.session = session
        req.init_next_round_input(self.tree)
        return req

    def commit(self, req: Req) -> None:
        """SGLang's own PrefillAdder._commit_prefill_admission (the probe's hook around it) on a
        stand-in adder: the request's prefix lock and extend_end; no budget is kept. Before 0.5.20: SGLang's
        own PrefillAdder.add_one_req on a real adder (no chunk limit; its token budget lifted by an offset
        of the whole pool: req-E is admitted to put the pool under pressure)."""
        if ADMISSION is None:
            adder = PrefillAdder(PS, self.tree, self.alloc, None, 0.0, CONTEXT * ROWS, None)
            adder.rem_total_token_offset = -PAGES * PS
            adder.add_one_req(req, False, None)
            assert adder.can_run_list == [req], f"{req.rid}: not admitted ({adder.budget_state()})"
            return
        adder = SimpleNamespace(
            tree_cache=self.tree,
            can_run_list=[],
            new_chunked_req=None,
            exact_chunk_fill=False,  # NOTE: read by 0.5.22's admission (a budget option: no budget is kept)
            _update_prefill_budget=lambda *args, **kwargs: None,
            _request_slot_reserve_for_req=lambda req, extend_input_len: 0,
            _account_prefill_cache_admission=lambda req, prefix_len: None,
        )
        adder._req_inc_lock_ref = lambda req: PrefillAdder._req_inc_lock_ref(adder, req)  # NOTE: before 0.5.22
        extend_len = len(req.origin_input_ids) - prefix_len(req)
        PrefillAdder._commit_prefill_admission(
            adder, req, ADMISSION(*(prefix_len(req), extend_len, 16, False, 0)[:ADMISSION_FIELDS]), 0
        )

    def take_row(self, req: Req, tokens: list[int], chunk: int | None = None) -> None:
        rid = req.rid
        if self.mamba and not req.kv.holds_mamba and self.rows.mamba_allocator.available_size() < 1:
            self.tree.evict(EvictParams(num_tokens=0, mamba_num=1))  # NOTE: what the scheduler's admission does
        sglang_hooks._in_context(
            None, "extend", lambda: self.rows.alloc([req])
        )  # NOTE: in prepare_for_extend: no request
        self.live[rid] = req
        prefix = prefix_len(req)
        ends = [min(len(tokens), prefix + chunk), len(tokens)] if chunk else [len(tokens)]
        for end in dict.fromkeys(ends):
            self.extend(req, end)
            prefix = end
            if not CHECKPOINT:  # NOTE: the request's prefill result: its tokens into the tree (the probe's hook)
                common.maybe_cache_unfinished_req(req, self.tree, **({"chunked": True} if end < len(tokens) else {}))

    def extend(self, req: Req, end: int) -> None:
        kv = KV_OF(req)
        start = kv.kv_allocated_len or prefix_len(req)
        row = self.rows.req_to_token[kv.req_pool_idx]
        if kv.kv_allocated_len:
            prefix_slots = row[:start].to(torch.int64)
        elif not CHECKPOINT:
            prefix_slots = req.prefix_indices.to(torch.int64)
        elif req.prefix_len:
            prefix_slots = self.tree.prefix_device_indices(req).to(torch.int64)
        else:
            prefix_slots = torch.empty((0,), dtype=torch.int64)
        self.make_room(end - start + PS)
        last = prefix_slots[-1:] if len(prefix_slots) else torch.full((1,), -1, dtype=torch.int64)
        prefix_lens, seq_lens = torch.tensor([start]), torch.tensor([end])
        if PS == 1:
            out = self.alloc.alloc(end - start)
        else:
            out = self.alloc.alloc_extend(prefix_lens, prefix_lens, seq_lens, seq_lens, last, end - start)
        assert out is not None, f"{req.rid}: no room for {end - start} tokens"
        if not req.retracted_stain:  # NOTE: what prepare_for_extend counts as SGLang's Req.cached_tokens
            req.cached_tokens += start - req.already_computed
            req.already_computed = end
        self.rows.write((kv.req_pool_idx, slice(0, end)), torch.cat((prefix_slots, out)).to(torch.int32))
        set_kv_len(req, end)
        if CHECKPOINT:
            self.tree.maybe_hand_to_session(req)  # NOTE: what alloc_for_extend does after each request's allocation
        probe.PROBE.next_step()  # NOTE: what the prepare_for_extend hook does around SGLang's own
        probe.PROBE.prepared([req], self.rows, self.tree, "extend", KV_OF)

    def decode(self, req: Req, steps: int) -> None:
        """One token per step; a new page whenever the last one is full."""
        for i in range(steps):
            kv = KV_OF(req)
            seq = kv.kv_allocated_len + 1
            self.make_room(PS)
            last = self.rows.req_to_token[kv.req_pool_idx, seq - 2 : seq - 1].to(torch.int64)
            if PS == 1:
                out = self.alloc.alloc(1)
            else:
                out = self.alloc.alloc_decode(torch.tensor([seq]), torch.tensor([seq]), last)
            self.rows.write((kv.req_pool_idx, slice(seq - 1, seq)), out.to(torch.int32))
            req.output_ids.append(7000 + i)
            set_kv_len(req, seq)
            probe.PROBE.next_step()
            probe.PROBE.prepared([req], self.rows, self.tree, "decode", KV_OF)

    def make_room(self, tokens: int) -> None:
        if self.alloc.available_size() < tokens:
            self.tree.evict(EvictParams(num_tokens=tokens - self.alloc.available_size()))
        if self.swa and self.alloc.swa_available_size() < tokens:
            self.tree.evict(EvictParams(swa_num_tokens=tokens - self.alloc.swa_available_size()))

    def release(self, req: Req) -> None:
        if req.rid != "req-D" or self.mamba:  # NOTE: finished by length, as the scheduler marks it (req-D is
            # released unfinished, but a Mamba tree takes only finished requests' states)
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        if CHECKPOINT:
            common.release_kv_cache(req, self.tree, checkpoint=True)  # NOTE: the hooked module global
        else:
            common.release_kv_cache(req, self.tree, is_insert=True)
        del self.live[req.rid]

    # -- the idle point -------------------------------------------------------------------------

    def idle(self) -> dict[str, Any]:
        """SGLang's count identity (raise on a leak, strict), then the probe's census."""
        owners = self.owners()
        uncached, swa_uncached = self.checker._get_total_uncached_sizes()  # NOTE: SGLang's own (its busy check's)
        full = self.alloc.full_available_size() if self.swa else self.alloc.available_size()
        session_held = self.session_held()
        leak, line = SchedulerInvariantChecker._check_pool_invariant(
            "full", full, self.tree.evictable_size(), self.tree.protected_size(), session_held, PAGES * PS, uncached
        )
        pool = "pool"
        if self.swa and not leak:
            swa_args = (self.tree.swa_evictable_size(), self.tree.swa_protected_size(), 0, PAGES * PS, swa_uncached)
            leak, line = SchedulerInvariantChecker._check_pool_invariant(
                "swa", self.alloc.swa_available_size(), *swa_args
            )
            pool = "swa pool"
        if self.mamba and not leak:  # NOTE: SGLang checks it fully idle only: live requests' slots count as uncached
            slots = self.rows.mamba_allocator
            held = len(owners) * (1 + self.rows.mamba_initial_tracking_slots)  # NOTE: a state and its track slots
            terms = (self.tree.mamba_evictable_size(), self.tree.mamba_protected_size(), 0, slots.size, held)
            leak, line = SchedulerInvariantChecker._check_pool_invariant("mamba", slots.available_size(), *terms)
        raised = None
        if leak:
            try:
                self.checker._report_leak(pool, line)
            except ValueError as err:  # NOTE: into the log as a scheduler's traceback ends (report engine-log reads it)
                raised = str(err).splitlines()[0]
                print(
                    f"Scheduler hit an exception: Traceback (most recent call last):\nValueError: {err}",
                    file=sys.stderr,
                    flush=True,
                )
        if not (leak or self.live):  # NOTE: SGLang counts the request rows fully idle only (no running request)
            try:
                self.checker._check_req_pool()
            except ValueError as err:  # NOTE: strict: on_idle raises before its end (the probe's idle census)
                leak, raised = True, str(err).splitlines()[0]
        census = None
        if not leak:
            probe.PROBE.busy = True
            census = probe.PROBE.census(self.tree, self.rows, owners, why="idle", live=LIVE)
        return {
            "sglang": {"leak": leak, "line": line, "raised": raised},
            "census": None if census is None else [c.as_json() for c in census],
            "reported": probe.PROBE.censuses,
        }

    def on_idle(self) -> dict[str, Any]:
        """SGLang's own Scheduler.on_idle (and the probe's hook around it, as a server runs it) on a
        stand-in scheduler: the engine's pools, tree and SGLang's invariant checker; no-ops for the
        metrics, events, load publishing and sleep it also does."""
        nothing = SimpleNamespace(
            drop_sync_wait_carry=lambda: None,
            record_scheduler_idle=lambda: None,
            record_scheduler_active=lambda t: None,
            _maybe_log_idle_metrics=lambda: None,
            publish_kv_events=lambda: None,
            reset=lambda: None,
            publish_load_stat=lambda *args, **kwargs: None,
            get_loads=None,
            record=lambda stage: contextlib.nullcontext(),
            enter=lambda stage: None,
            exit=lambda previous: None,
            _trace_stage=None,
        )
        scheduler = SimpleNamespace(
            dp_attn_adapter=nothing,
            metrics_reporter=nothing,
            kv_events_publisher=nothing,
            new_token_ratio_tracker=nothing,
            load_publisher=nothing,
            load_inquirer=nothing,
            scheduler_stage_metrics=nothing,
            maybe_send_health_check_signal=lambda: None,
            is_fully_idle=lambda: not self.live,
            publish_load_snapshot=lambda force: None,
            maybe_sleep_on_idle=lambda: None,
            enable_unified_memory=False,
            enable_hisparse=False,
            disaggregation_mode=DisaggregationMode.NULL,
            invariant_checker=self.checker,
            pool_stats_observer=self.checker.pool_stats_observer,
            token_to_kv_pool_allocator=self.alloc,
            tree_cache=self.tree,
            req_to_token_pool=self.rows,
        )
        raised = None
        try:
            Scheduler.on_idle(scheduler)
        except ValueError as err:
            raised = str(err).splitlines()[0]
        return {"sglang": {"leak": raised is not None, "line": None, "raised": raised}, "census": None}


class CpuLaunch:
    """A Triton kernel's launch (`kernel[grid](*args)`) done on the CPU by `run`: before 0.5.22 the paged
    allocator launches its Triton kernels whatever the platform (0.5.22 added its CPU path), and Triton is
    a stand-in here (sglang_standins)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def __getitem__(self, grid: Any) -> Any:
        return self.run


def _extend_on_cpu(prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any, out: Any, _: int, ps: int) -> None:
    paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out, ps, out.device)  # NOTE: SGLang's own


def _decode_on_cpu(seq_lens: Any, last_loc: Any, free_pages: Any, out: Any, _: int, ps: int) -> None:
    """One slot per request: the next in its last page, or the first of a new page (requests that start a
    page take the free pages in batch order), as the kernel does."""
    starts = ((seq_lens - 1) % ps == 0).to(torch.int64)
    if not len(free_pages):
        out.copy_(last_loc + 1)
        return
    rank = (torch.cumsum(starts, 0) - starts).clamp(max=len(free_pages) - 1)
    out.copy_(torch.where(starts.bool(), free_pages[rank] * ps, last_loc + 1))


if not hasattr(paged, "alloc_decode_naive"):
    paged.alloc_extend_kernel = CpuLaunch(_extend_on_cpu)
    paged.alloc_decode_kernel = CpuLaunch(_decode_on_cpu)


def fitted(cls: Any, **fields: Any) -> Any:
    """SGLang's dataclass `cls` made from the fields of `fields` it has (a release adds or drops some)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in fields.items() if name in names})


def free_page(alloc: Any, page: int) -> None:
    """The page given back to the allocator (free_page_ids from 0.5.20; before, its slots through free)."""
    if hasattr(alloc, "free_page_ids"):
        alloc.free_page_ids(torch.tensor([page]))
    else:
        alloc.free(torch.arange(page * PS, page * PS + PS))


def set_kv_len(req: Req, length: int) -> None:
    """The request's KV allocated and committed up to `length` (what alloc_for_extend / alloc_for_decode and
    the forward pass leave); on 0.5.18 its ReqKvInfo is made at its first allocation, as alloc_for_extend
    makes it, and its committed length is on Req."""
    if not ROW_ON_REQ:
        req.kv.kv_allocated_len = req.kv.kv_committed_len = length
        return
    if req.kv is None:
        req.kv = ReqKvInfo(kv_allocated_len=length, swa_evicted_seqlen=0)
    req.kv.kv_allocated_len = req.kv_committed_len = length


def prefix_len(req: Req) -> int:
    """The tokens of the request's match on the device (Req.prefix_len from 0.5.22; prefix_indices before)."""
    return int(req.prefix_len) if CHECKPOINT else len(req.prefix_indices)


def drop_lock(engine: Engine, req: Req) -> None:
    """The request's prefix lock dropped without its unlock (what its release would unlock)."""
    if CHECKPOINT:
        req.lock = None
    elif ADMISSION is not None:
        req.last_node = None  # NOTE: 0.5.20, 0.5.21: release_kv_cache unpins req.last_node (none: no unlock)
    else:  # NOTE: 0.5.19's release unlocks req.last_node whatever it is: the tree skips this request's unlock
        tree = engine.tree
        unlock = type(tree)._dec_req_lock
        tree._dec_req_lock = lambda r, **kwargs: None if r is req else unlock(tree, r, **kwargs)


def workload(engine: Engine, scenario: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    system = list(range(100, 112))  # 12 tokens: three pages every request shares
    injected: list[dict[str, Any]] = []
    points = []
    a = engine.admit("req-A", [*system, 1, 2, 3])
    engine.decode(a, 3)
    if scenario.startswith("row-leak"):  # its release gives back pages and lock, and forgets to free its row
        injected.append({"kind": "row-leak", "rid": "req-A", "row": int(KV_OF(a).req_pool_idx)})
        engine.rows.free = lambda req: None
        engine.release(a)
        del engine.rows.free
    else:
        engine.release(a)
    points.append(engine.on_idle() if scenario.startswith("row-leak") else engine.idle())
    if scenario == "batch-lock-leak":  # one prefill batch of two: match both, admit both, checkpoint both
        return batch_workload(engine, points, system)
    if scenario == "retract":  # a decode batch retracts one request, which comes back and finishes
        return retract_workload(engine, points, system)
    b = engine.admit("req-B", [*system, 4, 5, 6, 7, 8], chunk=8)  # chunked prefill, prefix hit on the tree
    lock_node = b.last_node
    if scenario == "lock-leak":  # the prefix lock is dropped without its unlock
        drop_lock(engine, b)
        injected.append({"kind": "lock-leak", "rid": "req-B", "node": sglang_probe._node(lock_node)})
    engine.decode(b, 2)
    engine.release(b)
    c = engine.admit("req-C", [*system, 9, 9, 9, 9, 9, 9])
    engine.decode(c, 1)
    if scenario in ("leak-tail", "leak-and-double-free"):  # the unaligned tail page is never given back
        kv = KV_OF(c)
        aligned = kv.kv_allocated_len // PS * PS
        tail = int(engine.rows.req_to_token[kv.req_pool_idx, aligned]) // PS
        set_kv_len(c, aligned)
        injected.append({"kind": "leak-tail", "rid": "req-C", "page": tail})
    if scenario == "swa-leak":  # the tail page is freed through the full sub-allocator only: its SWA peer strands
        kv = KV_OF(c)
        aligned = kv.kv_allocated_len // PS * PS
        tail_slots = engine.rows.req_to_token[kv.req_pool_idx, aligned : kv.kv_allocated_len].to(torch.int64)
        peer = int(engine.alloc.full_to_swa_index_mapping[tail_slots[0]]) // PS
        engine.alloc.full_attn_allocator.free(tail_slots)
        set_kv_len(c, aligned)
        injected.append({"kind": "swa-leak", "rid": "req-C", "page": peer})
    if scenario == "swa-padding":  # its first page's SWA peer freed out of the window twice: the second free
        # reads the mapping the first cleared, the padding slot 0, and SGLang (invariant checks off: its default)
        # puts page 0 in the SWA free list
        kv = KV_OF(c)
        first = engine.rows.req_to_token[kv.req_pool_idx, :PS].to(torch.int64)
        for _ in range(2):
            sglang_hooks._in_context("req-C", "free", lambda: engine.alloc.free_swa_segment(first, start_pos=0))
        injected.append({"kind": "swa-padding", "rid": "req-C", "page": 0})
    engine.release(c)
    mine = [50 + i for i in range(10)]
    if scenario in ("double-free-reused", "double-free-in-tree"):  # a tree page freed again, req-D's prefill takes it
        page = min(int(s) // PS for s in engine.tree.all_values_flatten().tolist())
        sglang_hooks._in_context("bad-free", "free", lambda: free_page(engine.alloc, page))
        injected.append({"kind": "double-free", "rid": "bad-free", "page": page})
    d = engine.admit("req-D", [*system, *mine] if scenario == "shared" else mine)  # running across the idle point
    if scenario in ("double-free", "leak-and-double-free"):  # a page still in the tree is freed again
        page = min(int(s) // PS for s in engine.tree.all_values_flatten().tolist())
        sglang_hooks._in_context("bad-free", "free", lambda: free_page(engine.alloc, page))
        injected.append({"kind": "double-free", "rid": "bad-free", "page": page})
    if scenario == "double-free-in-tree":  # req-D's release puts the page into a second tree node
        engine.release(d)
    if scenario == "group-double-free":  # a page still in the tree freed in a batch's free group, by no request's call
        page = min(int(s) // PS for s in engine.tree.all_values_flatten().tolist())
        engine.alloc.free_group_begin()
        engine.alloc.free(torch.arange(page * PS, page * PS + PS))
        engine.alloc.free_group_end()
        injected.append({"kind": "double-free", "rid": None, "page": page})
    points.append(engine.idle())
    e = engine.admit("req-E", [300 + i for i in range(32)])  # pressure: evicts the tree's leaves
    engine.release(e)
    if d.rid in engine.live:
        engine.release(d)
    points.append(engine.idle())
    return points, injected


def batch_workload(engine: Engine, points: list[dict[str, Any]], system: list[int]) -> tuple[list[Any], list[Any]]:
    """A prefill batch as the scheduler runs it: both waiting requests matched first (req-Q last), then
    admitted (SGLang's PrefillAdder commit: each one's prefix lock), their rows filled, then SGLang's
    checkpoint_kv_cache for each after the prefill (the tree re-locks each on its new node); req-P's
    release then finds no lock to drop (its lock leaks), req-Q's is clean."""
    p = engine.arrive("req-P", [*system, *range(20, 28)])
    q = engine.arrive("req-Q", [*system, *range(40, 48)])
    for req in (p, q):
        engine.commit(req)
        engine.take_row(req, list(req.origin_input_ids))
    for req in (p, q):
        common.checkpoint_kv_cache(req, engine.tree)
    node = sglang_probe._node(p.lock.node)
    p.lock = None
    engine.release(p)
    engine.release(q)
    points.append(engine.idle())
    return points, [{"kind": "lock-leak", "rid": "req-P", "node": node}]


def retract_workload(engine: Engine, points: list[dict[str, Any]], system: list[int]) -> tuple[list[Any], list[Any]]:
    """SGLang's own ScheduleBatch.retract_decode (the probe's hook around it) on a stand-in decode batch of
    two: it retracts req-R2 (fewer output tokens: SGLang's order) and releases its row and pages; req-R2
    comes back (prefilled again) and finishes; req-R1 finishes."""
    r1 = engine.admit("req-R1", [*system, 1, 2, 3])
    engine.decode(r1, 2)
    r2 = engine.admit("req-R2", [*system, 7, 8, 9])
    engine.decode(r2, 1)
    batch = SimpleNamespace(
        reqs=[r1, r2],
        req_to_token_pool=engine.rows,
        token_to_kv_pool_allocator=engine.alloc,
        tree_cache=engine.tree,
        hisparse_coordinator=None,
        _get_decode_retraction_order=ScheduleBatch._get_decode_retraction_order,
        filter_batch=lambda keep_indices: None,
    )
    batch.check_decode_mem = lambda selected_indices: len(selected_indices) < 2  # NOTE: room once one is out
    batch.release_req = lambda idx, remaining, offload_kv=True: ScheduleBatch.release_req(
        batch, idx, remaining, offload_kv
    )
    retracted, _, _ = ScheduleBatch.retract_decode(batch)
    assert [req.rid for req in retracted] == ["req-R2"], [req.rid for req in retracted]
    del engine.live["req-R2"]
    again = engine.admit("req-R2", [*system, 7, 8, 9])
    engine.decode(again, 2)
    engine.release(again)
    engine.release(r1)
    points.append(engine.idle())
    return points, [{"kind": "retract", "rid": "req-R2"}]


def session_workload(engine: Engine, scenario: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A streaming session's life (UnifiedRadixCache): its first turn matches a prefix in the tree and
    locks it; that request's row, pages and lock go to the session at the row's first allocation and
    stay with it when the request finishes; the second turn borrows them and gives them back to the
    session; `session-close` then closes the session (SGLang's controller: release_session);
    `session-lock-leak`: between the turns another request locks the node the session holds locked
    and never unlocks it. Idle points between the turns, after them, and after the close."""
    system = list(range(100, 112))
    points = []
    a = engine.admit("req-A", [*system, 1, 2, 3])  # NOTE: puts the shared prefix into the tree
    engine.decode(a, 1)
    engine.release(a)
    session = Session(4096, session_id="sess-1", streaming=True)
    first = engine.admit("req-S1", [*system, 4, 5, 6], session=session)
    engine.decode(first, 3)
    engine.release(first)  # NOTE: the session keeps the record and the prefix lock
    injected: list[dict[str, Any]] = []
    if scenario == "session-lock-leak":  # NOTE: another request's lock on the node the session holds, never released
        leaker = engine.admit("req-L", [*system, 9, 9, 9])
        injected.append({"kind": "lock-leak", "rid": "req-L", "node": sglang_probe._node(leaker.last_node)})
        leaker.lock = None
        engine.decode(leaker, 1)
        engine.release(leaker)
    points.append(engine.idle())
    second = engine.admit("req-S2", [*system, 4, 5, 6, 7000, 7001, 7002, 8, 9], session=session)
    engine.decode(second, 2)
    engine.release(second)
    points.append(engine.idle())
    if scenario == "session-close":
        sglang_hooks._in_context(
            None, "close", lambda: engine.tree.release_session("sess-1")
        )  # NOTE: the controller's close
        points.append(engine.idle())
    return points, injected


def mamba_workload(engine: Engine, scenario: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same request life on the Mamba tree: each finished request's state goes into the tree (a
    Mamba slot per node end); req-B continues req-A's sequence (a hit: SGLang copies the tree's state
    into a new slot at the match); req-E needs a slot when all four are taken (the tree evicts one)."""
    system = list(range(100, 112))
    injected: list[dict[str, Any]] = []
    points = []
    a = engine.admit("req-A", [*system, 1, 2, 3])
    engine.decode(a, 3)
    engine.release(a)
    points.append(engine.idle())
    b = engine.admit("req-B", [*system, 1, 2, 3, 7000, 7001, 7002, 4, 5])
    engine.decode(b, 2)
    engine.release(b)
    c = engine.admit("req-C", [*system, 9, 9, 9])
    engine.decode(c, 1)
    if scenario == "mamba-leak":  # released uncached, and the release path drops its slot without freeing it
        slot = int(c.kv.mamba_pool_idx)
        c.skip_radix_cache_insert = True
        engine.rows.free_mamba_cache = lambda req, *args, **kwargs: setattr(req.kv, "mamba_pool_idx", None)
        engine.release(c)
        del engine.rows.free_mamba_cache
        injected.append({"kind": "mamba-leak", "rid": "req-C", "slot": slot})
    else:
        engine.release(c)
    d = engine.admit("req-D", [50 + i for i in range(10)])  # stays running across the idle point
    if scenario == "mamba-double-free":  # a slot still in the tree is freed again
        slot = min(int(s) for s in engine.tree.all_mamba_values_flatten().tolist())
        sglang_hooks._in_context("bad-free", "free", lambda: engine.rows.mamba_allocator.free(torch.tensor([slot])))
        injected.append({"kind": "mamba-double-free", "rid": "bad-free", "slot": slot})
    points.append(engine.idle())
    e = engine.admit("req-E", [300 + i for i in range(8)])  # no free slot: the tree evicts a state
    engine.decode(e, 1)
    engine.release(e)
    engine.release(d)
    points.append(engine.idle())
    return points, injected


def mamba_rows(extra_buffer: bool) -> HybridReqToTokenPool:
    """SGLang's HybridReqToTokenPool with its MambaPool and MambaSlotAllocator (MAMBA_SLOTS slots), from a
    tiny Mamba2 state (one layer): what a hybrid Mamba model's scheduler builds, without the extra buffer."""
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=4
    )
    return HybridReqToTokenPool(
        size=ROWS,
        mamba_size=MAMBA_SLOTS,
        mamba_spec_state_size=MAMBA_SLOTS,
        max_context_len=CONTEXT,
        device="cpu",
        enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
        mamba_layer_ids=[0],
        enable_mamba_extra_buffer=extra_buffer,
    )


def publish_config() -> None:
    """SGLang reads its process-wide config (runtime_context) on the release path: publish one for a
    tiny local model config (no weights: nothing loads a model), as a scheduler process does."""
    import tempfile

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    model = Path(tempfile.mkdtemp(prefix="kvscope-sgl-model-"))
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 32000,
                "max_position_embeddings": 256,
                "torch_dtype": "float32",
            }
        )
    )
    args = ServerArgs(model_path=str(model), device="cpu", page_size=PS)
    args._mamba_cache_chunk_size = PS  # type: ignore[attr-defined]  # NOTE: as SGLang's fixtures seed it (no HF config)
    ranks = runtime_context.SpawnRanks(world_rank=0, dp_rank=DP_RANK) if DP_RANK is not None else None
    if ranks is None:  # NOTE: 0.5.20's publish takes no ranks (the dp scenario runs on the venv's 0.5.23)
        runtime_context.publish(args, role="scheduler")
    else:
        runtime_context.publish(args, role="scheduler", ranks=ranks)  # NOTE: a DP controller's replica names its rank


def _swapped(target: str, hook: Any) -> Any:
    """A table edit: `target`'s hook made for other parameters than SGLang's method has."""
    return lambda table: [h._replace(hook=hook) if h.target == target else h for h in table]


EDITS = {  # NOTE: scenario -> an edit of each family's hook table (its shapes follow the edited table)
    "missing-target": lambda table: [*table, probe.Hook(f"{probe.UNIFIED}.gone_in_0_5_24", sglang_hooks._h_event_loop)],
    "row-leak-unhooked": lambda table: [h for h in table if not h.target.endswith("._check_req_pool")],
    "changed-parameters": _swapped(f"{probe.PAGED}.alloc", sglang_hooks._d_alloc_decode),
    "changed-tree-parameters": _swapped(f"{probe.UNIFIED}.dec_lock_ref", sglang_hooks._d_radix_dec_lock),
    "changed-mamba-parameters": _swapped(f"{probe.MAMBA_SLOTS}.free", sglang_hooks._d_alloc_decode),
    # NOTE: 0.5.23: the leading parameters match (the shape holds); SGLang's method has one more (direct check)
    "changed-trailing-parameters": _swapped(f"{probe.UNIFIED}.evict_for_alloc", sglang_hooks._d_evict),
}


def main(scenario: str, tree_kind: str) -> None:
    edit = EDITS.get(scenario)
    if scenario == "untested-release":  # NOTE: the release in no family's tested list: loads by its shapes
        probe.FAMILIES = tuple(f._replace(releases=()) for f in probe.FAMILIES)
    elif edit is not None:  # NOTE: every family's table edited, its shapes taken again from the edited table
        probe.FAMILIES = tuple(
            sglang_shapes._family(f.name, f.releases, lambda f=f: edit(f.build()))  # type: ignore[misc]
            for f in probe.FAMILIES
        )
    if scenario == "dp":  # NOTE: the clean life on a DP controller's replica 1
        global DP_RANK
        DP_RANK = 1
    load_plugins()  # NOTE: SGLang's own: discovers the sglang.srt.plugins entry point, applies the hooks
    said = probe.PROBE.state.reason or ("registered" if probe.PROBE.state.active else "inert")
    configure(tree_kind)
    publish_config()
    engine = Engine(tree_kind)
    served, points, injected, error = True, [], [], None
    try:
        work = mamba_workload if engine.mamba else session_workload if scenario.startswith("session") else workload
        points, injected = work(engine, scenario)
    except Exception as err:  # NOTE: the engine's own objects failed: the test reports it
        served, error = False, f"{type(err).__name__}: {err}"
    rec = probe.PROBE.state.recorder
    if hasattr(rec, "close"):
        rec.close()
    patched = hasattr(PagedTokenToKVPoolAllocator._release_page_ids, "__wrapped__") or any(
        hasattr(tree.match_prefix, "__wrapped__") for tree in (RadixCache, UnifiedRadixCache)
    )
    tree_methods = ("match_prefix", "insert", "evict", "inc_lock_ref", "dec_lock_ref")
    made_by = {  # NOTE: whose code each tree method now runs first: the probe's (direct) or HookRegistry's wrapper
        f"{tree.__name__}.{name}": Path(getattr(tree, name).__code__.co_filename).name
        for tree in (RadixCache, UnifiedRadixCache)
        for name in (*tree_methods, *(("evict_for_alloc",) if tree is UnifiedRadixCache else ()))
        if hasattr(tree, name)  # NOTE: 0.5.18's UnifiedRadixCache has no evict_for_alloc
    }
    print(
        json.dumps(
            {
                "said": said,
                "active": probe.PROBE.state.active,
                "patched": patched,
                "made_by": made_by,
                "core": engine.core(),
                "points": points,
                "injected": injected,
                "served": served,
                "error": error,
            }
        )
    )


def run_cases(cases: list[str], out_dir: Path, run: Any) -> None:
    """Each case (`run(case)`) in a child forked after SGLang's imports, the costly part of a run, paid once
    for them all: the child records into its own capture (out_dir/<case>.db, its KVSCOPE_CAPTURE) and
    writes its stdout and stderr to out_dir/<case>.out and .err, then exits as a process does (its exit
    handlers run: the probe's last fold and the recorder's close). The parent never loads the probe. Prints
    one JSON line: case -> its exit code, stdout, stderr and capture."""
    results = {}
    for case in cases:
        name = case.replace(":", "-")
        capture, out, err = (out_dir / f"{name}{suffix}" for suffix in (".db", ".out", ".err"))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(case, capture, out, err, run)
        _, status = os.waitpid(pid, 0)
        results[case] = {
            "code": os.waitstatus_to_exitcode(status),
            "stdout": out.read_text(),
            "stderr": err.read_text(),
            "capture": str(capture),
        }
    print(json.dumps(results))


def _child(case: str, capture: Path, out: Path, err: Path, run: Any) -> None:
    import atexit
    import traceback

    code = 1
    try:
        os.environ["KVSCOPE_CAPTURE"] = str(capture)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        run(case)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # NOTE: as the process would exit: the probe's and the recorder's handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--cases":  # NOTE: --cases OUT_DIR SCENARIO:TREE ...: one child per case (run_cases)
        run_cases(sys.argv[3:], Path(sys.argv[2]), lambda case: main(*case.split(":")))
    else:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "unified")
