"""The SGLang probe's cost on SGLang 0.5.23's real classes: µs per allocator and per tree operation,
plain vs hooked at level summary and full, recording into a real capture.

    KVSCOPE_PYTHON=.venv/bin/python PYTHONPATH=. ~/.cache/kvscope/sglang-venv/bin/python -W ignore \\
        benchmarks/bench_probe_sglang.py [--no-write]

Sets its rows in the `## bench_probe_sglang` table of benchmarks/RESULTS.md.

NOTE: the first table, two rounds on SGLang's real calls, timed apart.
    allocator  PagedTokenToKVPoolAllocator (page size 4, 4096 pages): alloc(16 tokens) then free of
               them (free -> _release_page_ids): 2 hooked calls per round, then the probe's per-step
               ledger work, as if each round were a step (fold_if_due: a fold of the queued calls
               every 0.2 s or FOLD_CALLS (512) entries; a tree without it, before the bulk ledger: its drain)
    tree       UnifiedRadixCache (Python tree core) holding one 64-token sequence: match_prefix (a
               request's, 48 of 64 tokens hit), lock (inc_lock_ref), unlock (dec_lock_ref): 3 hooked
               calls per round
The hooks are the probe's as register() installs them (SGLang's HookRegistry, or patched directly);
plain puts SGLang's originals back on the classes (each hook's __wrapped__), so plain is SGLang's code.
Summary = what level summary registers: no allocator or tree hook (those methods stay SGLang's, see
docs/probe.md "Level summary on SGLang"), and the per-step ledger work (its binds are the `bind/step`
row below); full = hooks, ledger and events; `queue only` (allocator only) = the hooks at full with
their queue dropped where a fold would take it (no fold, no ledger, no events: what the calls cost
without the fold). Modes run in blocks of BLOCK_ROUNDS rounds, in a new
shuffled order each of BLOCK_REPEATS times; the table shows the median µs per call (wall and this
thread's CPU time; the process's CPU beside it, the probe's fold worker's included) and what the
hooks add: the median of each block's difference to the plain block of the same repetition (the
machine's speed drifts between blocks), and the middle half of those differences.

NOTE: the in-situ control: the same pure-Python work (a CONTROL_STEPS-step loop) timed alone, and
    inside the tree round around SGLang's own dec_lock_ref against a bare wrapper of it, in shuffled
    alternating blocks: how much more any Python costs between SGLang's calls on this machine than in
    a loop of its own (the second table's figures are such loops).

NOTE: the second table, the hooks' own work: each hook function called with a stub for SGLang's
    original (it returns the result a real call returned), against the stub called alone, in
    alternating rounds; median and min CPU ns added per call. SGLang's work is then out of the timing,
    so a sub-µs cost is not lost in its spread on a shared machine. `around` is HookRegistry's own
    AROUND wrapper with a no-op hook (what any plugin's hook costs); `match`, `lock`, `unlock`
    are UnifiedRadixCache's match_prefix / inc_lock_ref / dec_lock_ref as the probe puts them in
    place around the stub (as the allocator rows: the wrapper's cost is in the row); `alloc+drain/N` and
    `free+drain/N` are the paged allocator's alloc / _release_page_ids as the probe installs them
    around the stub (a direct patch: the probe's method; an AROUND hook: SGLang's wrapper and the
    hook, so the wrapper's cost is in the row) plus the fold (drain) of what they queued, forced
    once per N calls (2: about one scheduler step's allocator calls folded every step; 256: the
    bulk ledger's fold at FOLD_CALLS), then the
    marshal of the recorder's buffer its hand-off does (the socket write is left out, and with it the
    host process's work, which on a 2-core machine runs beside the timed thread and slows it).
    `mamba alloc+fold/N` is MambaSlotAllocator.alloc(1) as the probe puts it in place (around the
    stub) plus the fold (drain) of what it queued (forced once per N calls: Mamba calls come per
    request; they share the allocators' queue and fold) and the hand-off's marshal. `mamba
    alloc+free/N` is a request's life on SGLang's own alloc and free, per call (a round's two calls
    over 2): alloc(1) of a 512-slot pool, the slot written to a row of a mapping, the free of that
    row's view (rewritten after the call, as SGLang does), plus the fold every N rounds and the
    marshal; plain is the same on SGLang's methods alone. The probe keeps the alloc's slot (a view
    of free_slots) until the fold, and with it the free_slots tensor it came from, which plain frees
    at once here (a live SGLang request keeps its slot, and that tensor, itself).
    `bind/step x32` is not per call: the prepare_for_decode hook's bind for one decode step of 32
    running requests (rows of 512+ tokens), with a fold after every step (both levels).
"""

from __future__ import annotations

import argparse
import marshal
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.engines.sglang_standins import install

install()

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from benchmarks._results import Figure, this_run, write_figures  # noqa: E402
from kvscope.probe import sglang as probe  # noqa: E402
from kvscope.probe.sglang_ledger import FIELDS, FOLD_CALLS  # noqa: E402

ROUNDS = 3_000
REPEATS = 7
BLOCK_ROUNDS = 400  # the first table: rounds per timed block, modes alternating block by block
BLOCK_REPEATS = 121
MODES = ("plain", "summary", "full", "queue only")
CONTROL_STEPS = 20  # the in-situ control's loop
PS = 4
BATCH = 32  # requests in the bind measurement's decode batch
BIND_STEPS = 200


TARGET_US = 1.0
PER_CALL_OWN = ("match", "lock", "unlock", "alloc+drain/256", "free+drain/256", "mamba alloc+fold/256",
                "mamba alloc+free/256", "mamba alloc+free stub/256")  # fmt: skip
ABOUT = (
    "CPU that the SGLang probe adds per call of SGLang 0.5.23's real paged allocator and UnifiedRadixCache, "
    "per level, and each hook's own work around a stub for SGLang's call (SGLang's cost out of the timing)."
)


def verdict(added_us: float) -> str:
    return "met" if added_us <= TARGET_US else "not met"


def real_call_figures(
    group: str, mode: str, cpu: float, added: tuple[float, float, float], added_process: float
) -> Figure:
    """A row of the first table: SGLang's own time (plain) or what a mode adds, µs per real call (the
    engine thread's CPU, the target's measure; the process's beside it)."""
    if mode == "plain":
        return Figure(f"{group} plain: SGLang's own CPU per real call", f"{cpu:.2f} µs")
    low, mid, high = added
    value = f"{mid:+.2f} µs (middle half {low:+.2f} to {high:+.2f}); process CPU {added_process:+.2f}"
    if mode == "queue only":
        return Figure(f"{group} {mode}: CPU added per real call", value)
    return Figure(f"{group} {mode}: CPU added per real call", value, f"≤ {TARGET_US:g} µs", verdict(mid))


def own_work_figure(name: str, added_ns: float, least_ns: float) -> Figure | None:
    """A row of the second table (level full), or None for the rows RESULTS.md leaves to the output."""
    value = f"{added_ns:+.0f} ns (min-min {least_ns:+.0f})"
    if name.startswith("bind/step"):
        return Figure(f"own work, {name} (per decode step, not per call)", f"{added_ns / 1e3:.0f} µs per step")
    if name == "around":
        return Figure("HookRegistry's AROUND wrapper, a no-op hook (SGLang's, any plugin pays it)", value)
    if name not in PER_CALL_OWN:
        return None
    return Figure(f"own work around a stub, {name}, level full", value, f"≤ {TARGET_US:g} µs", verdict(added_ns / 1e3))


def build() -> tuple[Any, Any]:
    alloc = PagedTokenToKVPoolAllocator(4096 * PS, PS, torch.int64, "cpu", None, False)
    rows = ReqToTokenPool(8, 128, "cpu", False)
    tree = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=rows,
            token_to_kv_pool_allocator=alloc,
            page_size=PS,
            tree_components=(ComponentType.FULL,),
            tree_core_backend="python",
        )
    )
    value = alloc.alloc(64)
    tree.insert(InsertParams(key=RadixKey(array("q", range(1000, 1064))), value=value))
    return alloc, tree


def allocator_round(alloc: Any, drain: Any, rounds: int = ROUNDS) -> None:
    for _ in range(rounds):
        out = alloc.alloc(16)
        alloc.free(out)
        drain()  # NOTE: the per-step ledger work (its cost counts) as if every 2 calls were a step


def tree_round(tree: Any, params: Any, rounds: int = ROUNDS) -> None:
    for _ in range(rounds):
        node = tree.match_prefix(params).last_device_node
        tree.unlock(tree.lock(node))


def own_work(alloc: Any, tree: Any, params: Any) -> list[tuple[str, list[float], list[float]]]:
    """CPU ns per call: (name, stub alone per round, hook around the stub per round)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    probe.PROBE.drain()  # NOTE: nothing of the first table left to fold
    matched = tree.match_prefix(params)
    node = matched.last_device_node
    locked = tree.inc_lock_ref(node)
    tree.dec_lock_ref(node, locked.to_dec_params())
    out = alloc.alloc(16)
    alloc.free(out)
    freed = (out[::PS] // PS).clone()  # NOTE: the page ids a free of `out` releases

    def stub(_self: Any, *_args: Any) -> Any:
        return stub.result  # type: ignore[attr-defined]

    def noop(original: Any, *args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    items = probe.PROBE.state.recorder._items

    fold_mamba = getattr(probe.PROBE, "fold_mamba", lambda: None)  # NOTE: before the shared fold: its own

    def fold_and_hand_off() -> None:  # NOTE: the fold, then the hand-off's marshal of what it emitted
        probe.PROBE.drain()
        fold_mamba()
        marshal.dumps((items, [], None))
        items.clear()

    around = _wrap_fn(stub, noop, HookType.AROUND)
    match_as_installed = _as_installed("UnifiedRadixCache.match_prefix", stub)
    lock_as_installed = _as_installed("UnifiedRadixCache.inc_lock_ref", stub)
    unlock_as_installed = _as_installed("UnifiedRadixCache.dec_lock_ref", stub)
    unlock_params = locked.to_dec_params()
    alloc_as_installed = _as_installed("PagedTokenToKVPoolAllocator.alloc", stub)
    free_as_installed = _as_installed("PagedTokenToKVPoolAllocator._release_page_ids", stub)
    cases: list[tuple[str, Any, Any, Any, int]] = [
        ("around", matched, lambda: around(tree, params), None, 0),
        ("match", matched, lambda: match_as_installed(tree, params), None, 0),
        ("lock", locked, lambda: lock_as_installed(tree, node), None, 0),
        ("unlock", None, lambda: unlock_as_installed(tree, node, unlock_params), None, 0),
        *((f"alloc+drain/{n}", out, lambda: alloc_as_installed(alloc, 16), fold_and_hand_off, n) for n in (2, 32, 256)),
        *(
            (f"free+drain/{n}", None, lambda: free_as_installed(alloc, freed), fold_and_hand_off, n)
            for n in (2, 32, 256)
        ),
    ]
    slots = MambaSlotAllocator(512, "cpu")
    sglang_alloc = _attr(f"{probe.MAMBA_SLOTS}.alloc").__wrapped__
    sglang_free = _attr(f"{probe.MAMBA_SLOTS}.free").__wrapped__
    mamba_alloc = _as_installed("MambaSlotAllocator.alloc", stub)
    pair_alloc = _as_installed("MambaSlotAllocator.alloc", sglang_alloc)
    pair_free = _as_installed("MambaSlotAllocator.free", sglang_free)
    row = torch.full((2,), -1, dtype=torch.int64)  # NOTE: a request's row of a mapping

    def pair(alloc_of: Any, free_of: Any) -> None:  # NOTE: a request takes a slot, then gives its row's view back
        row[1] = alloc_of(slots, 1)[0]
        free_of(slots, row[1:2])
        row[1] = -1  # NOTE: SGLang rewrites the row after the free

    roots = [torch.arange(1, 513), torch.arange(1, 513)]  # NOTE: the stubs' free_slots, as SGLang's would be
    heads, popped, turn = [r[:1] for r in roots], [r[1:] for r in roots], [0]

    def alloc_stub(self: Any, need_size: int) -> Any:  # NOTE: SGLang's pop, its tensors made beforehand
        self.free_slots = popped[turn[0]]
        return heads[turn[0]]

    def free_stub(self: Any, free_index: Any) -> None:  # NOTE: SGLang's new free_slots, made beforehand
        turn[0] ^= 1
        self.free_slots = roots[turn[0]]

    stub_alloc = _as_installed("MambaSlotAllocator.alloc", alloc_stub)
    stub_free = _as_installed("MambaSlotAllocator.free", free_stub)
    plain_of = {f"mamba alloc+free/{n}": lambda: pair(sglang_alloc, sglang_free) for n in (32, 256)}
    plain_of["mamba alloc+free stub/256"] = lambda: free_stub(slots, alloc_stub(slots, 1))
    cases += [
        *(
            (f"mamba alloc+fold/{n}", slots.free_slots[:1], lambda: mamba_alloc(slots, 1), fold_and_hand_off, n)
            for n in (32, 256)
        ),
        *(
            (f"mamba alloc+free/{n}", None, lambda: pair(pair_alloc, pair_free), fold_and_hand_off, n)
            for n in (32, 256)
        ),
        ("mamba alloc+free stub/256", None, lambda: stub_free(slots, stub_alloc(slots, 1)), fold_and_hand_off, 256),
    ]
    rows = [bind_step()]
    for name, result, hooked, drain, every in cases:
        stub.result = result  # type: ignore[attr-defined]
        plain = plain_of.get(name, lambda: stub(tree, params))
        plain_ns, hooked_ns = [], []
        for _ in range(REPEATS * 3):
            plain_ns.append(_cpu_ns(plain))
            hooked_ns.append(_cpu_ns(hooked, drain, every))
        if name.startswith("mamba alloc+free"):  # NOTE: two hooked calls a round: per call
            plain_ns, hooked_ns = [x / 2 for x in plain_ns], [x / 2 for x in hooked_ns]
        rows.append((name, plain_ns, hooked_ns))
        probe.PROBE.locks.clear()
    return rows


def _as_installed(target_end: str, stub: Any) -> Any:
    """The probe's hook on the target as it is put in place, around `stub` for SGLang's method: the
    probe's own method (a direct hook) or SGLang's AROUND wrapper around the hook."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    hook = next(h for h in probe.hooks() if h.target.endswith(target_end))
    if getattr(hook, "direct", False):
        return hook.hook(stub)
    return _wrap_fn(stub, hook.hook, HookType.AROUND)


def bind_step() -> tuple[str, list[float], list[float]]:
    """The prepare_for_decode hook's bind, per decode step of BATCH requests whose rows hold 512
    tokens and grow by one each step (rows filled with real pages; the stub is no work: 0)."""
    rows = ReqToTokenPool(BATCH, 1024, "cpu", False)
    alloc = PagedTokenToKVPoolAllocator(BATCH * 1024, PS, torch.int64, "cpu", None, False)
    reqs = []
    for i in range(BATCH):
        req = Req(f"bind-{i}", "", array("q", range(512)), SamplingParams(max_new_tokens=1))
        rows.alloc([req])
        slots = alloc.alloc(1024)
        rows.write((req.kv.req_pool_idx, slice(0, 1024)), slots.to(torch.int32))
        req.kv.kv_allocated_len = 512
        reqs.append(req)
    bind = probe.PROBE.bind_requests
    per_step = []
    for _ in range(REPEATS * 3):
        start = time.thread_time_ns()
        for _ in range(BIND_STEPS):
            for req in reqs:
                req.kv.kv_allocated_len += 1
            bind(reqs, rows, PS, alloc, "decode")
            probe.PROBE.drain()  # NOTE: its fold (where bind queues its pages), as if every step folded
        per_step.append((time.thread_time_ns() - start) / BIND_STEPS)
        for req in reqs:
            req.kv.kv_allocated_len = 512
    return f"bind/step x{BATCH}", [0.0] * len(per_step), per_step


def _cpu_ns(call: Any, drain: Any = None, every: int = 0) -> float:
    start = time.thread_time_ns()
    for i in range(ROUNDS):
        call()
        if drain is not None and i % every == every - 1:
            drain()
    return (time.thread_time_ns() - start) / ROUNDS


def timed(run: Any, calls: int) -> tuple[float, float, float]:
    """µs per call: wall, this (the engine's) thread's CPU, and the process's CPU, the probe's fold
    worker's included (the block's end waits for it to finish what the block handed it)."""
    start, start_cpu, start_process = time.perf_counter(), time.thread_time(), time.process_time()
    run()
    cpu = time.thread_time()
    settle(probe.PROBE)
    wall, process = time.perf_counter(), time.process_time()
    return (wall - start) / calls * 1e6, (cpu - start_cpu) / calls * 1e6, (process - start_process) / calls * 1e6


def settle(probe: Any) -> None:
    """Until the probe's fold worker (if its ledger has one) has folded what it was handed."""
    ledger = getattr(probe, "ledger", None)
    lock = getattr(ledger, "lock", None)
    if lock is None:
        return
    for _ in range(100_000):  # NOTE: taken batches wait for the worker; it pops each under the lock
        if not ledger.batches:
            break
        time.sleep(0.0002)
    with lock:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args()
    capture = Path(tempfile.mkdtemp(prefix="kvscope-bench-sgl-")) / "bench.db"
    os.environ["KVSCOPE_CAPTURE"] = str(capture)
    os.environ.setdefault("KVSCOPE_PYTHON", sys.executable)
    os.environ["KVSCOPE_LEVEL"] = "full"  # NOTE: every hook in place; `lean` below is what summary keeps
    said = probe._register()
    HookRegistry.apply_hooks()
    hooked = {t.target: _attr(t.target) for t in probe.hooks()}
    plain = {target: attr.__wrapped__ for target, attr in hooked.items()}
    lean = {
        t.target: (plain if t.per_op else hooked)[t.target] for t in probe.hooks()
    }  # NOTE: as level summary registers
    alloc, tree = build()
    req = Req("bench", "", array("q", [*range(1000, 1048), *range(5000, 5016)]), SamplingParams(max_new_tokens=1))
    params = MatchPrefixParams(key=RadixKey(array("q", [*range(1000, 1048), *range(5000, 5016)])), req=req)
    assert probe.PROBE.recorder() is not None, "the probe did not open its recorder"
    emit = probe.PROBE.emit
    fold_if_due = getattr(probe.PROBE, "fold_if_due", None)  # NOTE: absent before the bulk ledger: drain per step
    per_step = probe.PROBE.drain if fold_if_due is None else lambda: fold_if_due(time.monotonic())
    pending = probe.PROBE.pending

    def queue_only() -> None:  # NOTE: the hooks' queue dropped where the fold would take it: no ledger, no events
        if len(pending) >= FOLD_CALLS * FIELDS:
            pending.clear()

    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    order = random.Random(0)
    for _ in range(BLOCK_REPEATS):  # NOTE: short blocks, the modes in a new order each time: the drift hits them alike
        for mode in order.sample(MODES, len(MODES)):
            _install(plain if mode == "plain" else lean if mode == "summary" else hooked)
            probe.PROBE.emit = emit if mode == "full" else None
            drain = {"plain": lambda: None, "queue only": queue_only}.get(mode, per_step)
            results.setdefault(("allocator", mode), []).append(
                timed(lambda d=drain: allocator_round(alloc, d, BLOCK_ROUNDS), 2 * BLOCK_ROUNDS)
            )
            if mode != "queue only":  # NOTE: the tree's hooks queue nothing
                results.setdefault(("tree", mode), []).append(
                    timed(lambda: tree_round(tree, params, BLOCK_ROUNDS), 3 * BLOCK_ROUNDS)
                )
            probe.PROBE.state.recorder.idle()
    _install(plain)
    control = python_in_situ(tree, params)
    _install(hooked)
    probe.PROBE.emit = emit
    own = own_work(alloc, tree, params)
    if not probe.PROBE.state.active:  # NOTE: the hooks went inert: these figures would time nothing
        raise SystemExit(f"recording stopped during the bench: {probe.PROBE.state.reason}")
    probe.PROBE.state.recorder.close()
    print(
        f"{said}; machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"torch {torch.__version__}; first table {BLOCK_ROUNDS} rounds x {BLOCK_REPEATS} blocks a mode, "
        f"second {ROUNDS} rounds x {REPEATS * 3}"
    )
    header = ("operation", "mode", "wall µs/call", "cpu µs/call", "added wall", "added cpu", "(middle half)")
    print(
        f"{header[0]:<10} {header[1]:<10} {header[2]:>12} {header[3]:>12} {header[4]:>11} {header[5]:>10}  {header[6]}"
        "  added process cpu"
    )
    figures: list[Figure] = []
    for group in ("allocator", "tree"):
        base = results[(group, "plain")]
        for mode in MODES:
            mine = results.get((group, mode))
            if mine is None:
                continue
            wall, cpu = (statistics.median(x[i] for x in mine) for i in (0, 1))
            added_wall = statistics.median(m[0] - b[0] for m, b in zip(mine, base, strict=True))
            low, added_cpu, high = _quartiles([m[1] - b[1] for m, b in zip(mine, base, strict=True)])
            added_process = statistics.median(m[2] - b[2] for m, b in zip(mine, base, strict=True))
            added = (
                ""
                if mode == "plain"
                else f"{added_wall:+11.2f} {added_cpu:+10.2f}  {low:+.2f} to {high:+.2f}  {added_process:+.2f}"
            )
            print(f"{group:<10} {mode:<10} {wall:12.2f} {cpu:12.2f} {added}")
            figures.append(real_call_figures(group, mode, cpu, (low, added_cpu, high), added_process))
    hot_ns, (low, added_ns, high) = control
    print(
        f"\nthe same Python work (a {CONTROL_STEPS}-step loop), CPU ns: alone {hot_ns:.0f}; inside the tree "
        f"round (around SGLang's dec_lock_ref), added over a bare wrapper: {added_ns:+.0f} "
        f"(middle half {low:+.0f} to {high:+.0f})"
    )
    print("\nthe hooks' own work (level full), CPU ns per call: stub alone, added by the hook (median, min-min)")
    for name, plain_ns, hooked_ns in own:
        base = statistics.median(plain_ns)
        added, least = statistics.median(hooked_ns) - base, min(hooked_ns) - min(plain_ns)
        print(f"{name:<20} {base:8.0f} {added:+9.0f} {least:+9.0f}")
        row = own_work_figure(name, added, least)
        if row is not None:
            figures.append(row)
    figures.append(
        Figure(
            f"control: a {CONTROL_STEPS}-step Python loop, alone / added between SGLang's calls",
            f"{hot_ns:.0f} ns alone, {added_ns:+.0f} ns in situ (middle half {low:+.0f} to {high:+.0f})",
        )
    )
    if not args.no_write:
        write_figures("bench_probe_sglang", ABOUT, figures, this_run("cpu"))
    return 0


def python_in_situ(tree: Any, params: Any) -> tuple[float, tuple[float, float, float]]:
    """How much more the same pure-Python work costs between SGLang's calls than alone: a
    CONTROL_STEPS-step loop, timed alone (CPU ns per call), and around SGLang's own
    UnifiedRadixCache.dec_lock_ref in the tree round, against a bare wrapper of that method, in
    shuffled alternating blocks (the added CPU ns per call: quartiles of the paired differences)."""
    owner = type(tree)
    sglang_dec = owner.__dict__["dec_lock_ref"]

    def work() -> None:
        for _ in range(CONTROL_STEPS):
            pass

    def bare(self: Any, node_id: Any, params: Any, skip_swa: bool = False) -> Any:
        return sglang_dec(self, node_id, params, skip_swa)

    def with_work(self: Any, node_id: Any, params: Any, skip_swa: bool = False) -> Any:
        result = sglang_dec(self, node_id, params, skip_swa)
        work()
        return result

    start = time.thread_time_ns()
    for _ in range(ROUNDS * 10):
        work()
    alone = (time.thread_time_ns() - start) / (ROUNDS * 10)
    times: dict[str, list[float]] = {"bare": [], "work": []}
    order = random.Random(1)
    try:
        for _ in range(BLOCK_REPEATS):
            for name in order.sample(sorted(times), 2):
                owner.dec_lock_ref = bare if name == "bare" else with_work
                start = time.thread_time_ns()
                tree_round(tree, params, BLOCK_ROUNDS)
                times[name].append((time.thread_time_ns() - start) / BLOCK_ROUNDS)
    finally:
        owner.dec_lock_ref = sglang_dec
    return alone, _quartiles([w - b for w, b in zip(times["work"], times["bare"], strict=True)])


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    low, mid, high = statistics.quantiles(values, n=4)
    return low, mid, high


def _attr(target: str) -> Any:
    import pkgutil

    owner, _, name = target.rpartition(".")
    obj = pkgutil.resolve_name(owner)
    return obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)


def _install(attrs: dict[str, Any]) -> None:
    import pkgutil

    for target, attr in attrs.items():
        owner, _, name = target.rpartition(".")
        obj = pkgutil.resolve_name(owner)
        if isinstance(obj, type):
            setattr(obj, name, attr)


if __name__ == "__main__":
    raise SystemExit(main())
