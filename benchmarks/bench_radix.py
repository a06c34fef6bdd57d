"""Radix-cache replay: kvscope's RadixCache on JSONL traces, side by side with SGLang's.

    .venv/bin/python benchmarks/gen_traces.py
    .venv/bin/python benchmarks/bench_radix.py benchmarks/traces/shared_prefix.jsonl \\
        benchmarks/traces/multi_turn.jsonl [--page-size 1 16] [--capacity 200000] [--policy lru] [--no-write]

Prints Markdown tables; with --write (the default) also sets its rows in the
`## bench_radix` table of benchmarks/RESULTS.md.

NOTE: one request of the replay (prompt P, output O, all_ids = P + O, seq_len = |all_ids|)
    match   m = match_prefix(P, user)                      timed
            inc_lock_ref(m.last_node)
    evict   need = ceil_ps(seq_len) - prefix_len tokens (whole pages); if available < need:
            evict(min(need - available, evictable_size()))  timed, only when > 0
    alloc   page size 1: alloc(seq_len - prefix_len); else alloc_extend with last_loc the
            last matched slot or -1. Still short: unlock, count the request as skipped.
    insert  p = insert(all_ids, prefix slots + new slots, user)   timed
            free the duplicates slots[prefix_len:p] and the sub-page tail slots[floor_ps(seq_len):]
            dec_lock_ref(m.last_node)
Nothing runs between requests, so the tree only holds finished requests; with 200k slots
both traces overflow the pool and evict. The traces are loaded, and converted to each
cache's key type, before any timing.

The SGLang side (same process, same protocol) runs when `sglang` is importable: its
classic `sglang.srt.mem_cache.radix_cache.RadixCache` with its own TokenToKVPoolAllocator
(page size 1) or PagedTokenToKVPoolAllocator. Its paged `alloc_extend` is a Triton kernel,
so on CPU the replay takes whole pages with its `alloc()`: prefixes are page-aligned, so
that hands out the same slots alloc_extend would. SGLang's cache has no user namespace
(a user goes in `extra_key` only to isolate), so its keys carry no user; kvscope's
RadixCache only records the user as the node owner, so the hit counts must agree.

Setup of the SGLang environment (optional; `make test` never needs it). torch stays the
CPU 2.13.0 build; sglang itself goes in without its dependencies (they pull CUDA), then the
few packages its `mem_cache.radix_cache` import chain needs:

    python3.11 -m venv /work/sglang-venv
    /work/sglang-venv/bin/pip install torch==2.13.0
    /work/sglang-venv/bin/pip install --no-deps sglang==0.5.18 torchvision==0.28.0
    echo torch==2.13.0 > /tmp/sglang-constraints.txt
    /work/sglang-venv/bin/pip install -c /tmp/sglang-constraints.txt \\
        transformers==5.12.1 openai==2.6.1 xgrammar==0.2.1 numpy orjson psutil pybase64 \\
        requests triton packaging pillow starlette msgspec IPython pydantic tqdm pyzmq \\
        aiohttp dill partial_json_parser sentencepiece compressed-tensors gguf
    /work/sglang-venv/bin/pip install --no-deps -e /work/main
    /work/sglang-venv/bin/python benchmarks/bench_radix.py benchmarks/traces/*.jsonl

pip reports sglang's other requirements as missing (and apache-tvm-ffi as newer than pinned);
that is expected, as nothing on the radix cache's import path uses them.

PyPI's torchvision wheel is built against CUDA torch, so its C ops do not load on the CPU
torch, and torchvision 0.28's `_meta_registrations` then fails on the missing
`torchvision::nms` schema. `import_sglang` defines the two schemas it registers fakes for
(nms, qnms) when, and only when, that happens; no torchvision op is ever called here.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from array import array
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch
from _results import Figure, command_line, machine, this_run, write_figures

from kvscope.cache import RadixCache
from kvscope.mem import make_token_allocator

ns = time.perf_counter_ns


class Trace(NamedTuple):
    name: str
    prompts: list[np.ndarray]  # int32
    all_ids: list[np.ndarray]  # int32, prompt + output
    users: list[str]


def load_trace(path: Path) -> Trace:
    prompts, all_ids, users = [], [], []
    with path.open() as f:
        for line in f:
            request = json.loads(line)
            prompt = np.array(request["prompt"], dtype=np.int32)
            output = np.array(request["output"], dtype=np.int32)
            prompts.append(prompt)
            all_ids.append(np.concatenate((prompt, output)))
            users.append(request["user"])
    return Trace(path.stem, prompts, all_ids, users)


def ceil_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


# -- the two sides -------------------------------------------------------------------------
# NOTE: a side exposes match(i) -> (slots, node), lock/unlock(node), evict(num_tokens),
# insert(i, slots) -> prefix_len, alloc(prefix_len, seq_len, last_loc), free(slots),
# available_size(), evictable_size(), protected_size(), check(). Each timed call is one
# method call on either side, wrapping the cache's own call.


class KvscopeSide:
    label = "kvscope"

    def __init__(self, trace: Trace, capacity: int, page_size: int, policy: str) -> None:
        self.trace = trace
        self.page_size = page_size
        self.allocator = make_token_allocator(capacity, page_size, "cpu")
        self.cache = RadixCache(self.allocator, page_size=page_size, eviction_policy=policy, req_to_token_pool=None)

    def match(self, i: int) -> tuple[torch.Tensor, Any]:
        m = self.cache.match_prefix(self.trace.prompts[i], self.trace.users[i])
        return m.device_indices, m.last_node

    def insert(self, i: int, slots: torch.Tensor) -> int:
        return self.cache.insert(self.trace.all_ids[i], slots, self.trace.users[i])

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict_tokens(num_tokens)

    def lock(self, node: Any) -> None:
        self.cache.inc_lock_ref(node)

    def unlock(self, node: Any) -> None:
        self.cache.dec_lock_ref(node)

    def alloc(self, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor | None:
        if self.page_size == 1:
            return self.allocator.alloc(seq_len - prefix_len)
        return self.allocator.alloc_extend([prefix_len], [seq_len], [last_loc], seq_len - prefix_len)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        return self.cache.evictable_size()

    def protected_size(self) -> int:
        return self.cache.protected_size()

    def check(self) -> None:
        self.cache.check_integrity()
        self.allocator.check_integrity(self.cache.tree_slots())


class SglangSide:
    label = "SGLang"

    def __init__(self, sgl: SimpleNamespace, keys: SglangKeys, capacity: int, page_size: int, policy: str) -> None:
        self.sgl, self.keys, self.page_size = sgl, keys, page_size
        if page_size == 1:
            self.allocator = sgl.TokenToKVPoolAllocator(capacity, torch.int64, "cpu", None, False)
        else:
            self.allocator = sgl.PagedTokenToKVPoolAllocator(capacity, page_size, torch.int64, "cpu", None, False)
        params = sgl.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
            eviction_policy=policy,
        )
        self.cache = sgl.RadixCache(params)

    def match(self, i: int) -> tuple[torch.Tensor, Any]:
        sgl = self.sgl
        m = self.cache.match_prefix(sgl.MatchPrefixParams(key=sgl.RadixKey(self.keys.prompts[i])))
        return m.device_indices, m.last_device_node

    def insert(self, i: int, slots: torch.Tensor) -> int:
        sgl = self.sgl
        result = self.cache.insert(sgl.InsertParams(key=sgl.RadixKey(self.keys.all_ids[i]), value=slots))
        return result.prefix_len

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(self.sgl.EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def lock(self, node: Any) -> None:
        self.cache.inc_lock_ref(node)

    def unlock(self, node: Any) -> None:
        self.cache.dec_lock_ref(node)

    def alloc(self, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor | None:
        if self.page_size == 1:
            return self.allocator.alloc(seq_len - prefix_len)
        assert prefix_len % self.page_size == 0, f"prefix_len {prefix_len} not page-aligned"
        num_pages = ceil_pages(seq_len, self.page_size) - prefix_len // self.page_size
        slots = self.allocator.alloc(num_pages * self.page_size)
        return None if slots is None else slots[: seq_len - prefix_len]

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        return self.cache.evictable_size()

    def protected_size(self) -> int:
        return self.cache.protected_size()

    def check(self) -> None:
        pass  # SGLang's classic RadixCache has no integrity check; conservation is checked by replay


class SglangKeys(NamedTuple):
    prompts: list[array]
    all_ids: list[array]


def sglang_keys(trace: Trace) -> SglangKeys:
    def as_array(ids: np.ndarray) -> array:
        out = array("q")
        out.frombytes(ids.astype(np.int64).tobytes())
        return out

    return SglangKeys([as_array(p) for p in trace.prompts], [as_array(a) for a in trace.all_ids])


def define_missing_torchvision_ops() -> None:
    """Let a CUDA-built torchvision import on CPU torch (see the module docstring)."""
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    define_missing_torchvision_ops.lib = lib  # type: ignore[attr-defined]  # the definitions live as long as it


def import_sglang() -> tuple[SimpleNamespace | None, str]:
    """SGLang's radix cache and allocators, or None and why not."""
    if importlib.util.find_spec("sglang") is None:
        return None, "not installed"
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass  # the sglang import below says what is missing
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        define_missing_torchvision_ops()
    try:
        from sglang.srt.mem_cache import radix_cache
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.version import __version__
    except ImportError as e:
        return None, f"installed but not importable: {e}"
    sgl = SimpleNamespace(
        RadixCache=radix_cache.RadixCache,
        RadixKey=radix_cache.RadixKey,
        CacheInitParams=CacheInitParams,
        MatchPrefixParams=MatchPrefixParams,
        InsertParams=InsertParams,
        EvictParams=EvictParams,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
    )
    return sgl, __version__


# -- replay ------------------------------------------------------------------------------------


class ReplayResult(NamedTuple):
    label: str
    trace: str
    page_size: int
    prefix_lens: np.ndarray  # per request; -1 for a skipped request
    num_prompt_tokens: int
    match_ns: int
    insert_ns: int
    evict_ns: int
    alloc_ns: int
    free_ns: int
    num_inserts: int
    num_evict_calls: int
    num_evicted_tokens: int
    wall_ns: int

    @property
    def num_requests(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_skipped(self) -> int:
        return int((self.prefix_lens < 0).sum())

    @property
    def num_matched_tokens(self) -> int:
        return int(self.prefix_lens[self.prefix_lens > 0].sum())

    @property
    def match_us(self) -> float:
        return self.match_ns / 1e3 / self.num_requests

    @property
    def insert_us(self) -> float:
        return self.insert_ns / 1e3 / max(self.num_inserts, 1)

    @property
    def evict_us(self) -> float:
        return self.evict_ns / 1e3 / max(self.num_evict_calls, 1)

    @property
    def alloc_us(self) -> float:
        return self.alloc_ns / 1e3 / self.num_requests

    @property
    def free_us(self) -> float:
        return self.free_ns / 1e3 / max(self.num_inserts, 1)

    @property
    def matched_tokens_per_s(self) -> float:
        return self.num_matched_tokens / (self.match_ns / 1e9)

    @property
    def hit_rate(self) -> float:
        return self.num_matched_tokens / self.num_prompt_tokens

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / (self.wall_ns / 1e9)


def replay(side: Any, trace: Trace, page_size: int) -> ReplayResult:
    num_requests = len(trace.prompts)
    prefix_lens = np.full(num_requests, -1, dtype=np.int64)
    match_ns = insert_ns = evict_ns = alloc_ns = free_ns = 0
    num_inserts = num_evict_calls = num_evicted_tokens = 0
    gc.collect()
    wall_start = ns()
    for i in range(num_requests):
        seq_len = len(trace.all_ids[i])
        t0 = ns()
        prefix_slots, node = side.match(i)
        match_ns += ns() - t0
        prefix_len = len(prefix_slots)
        side.lock(node)
        need = ceil_pages(seq_len, page_size) * page_size - prefix_len
        shortfall = need - side.available_size()
        if shortfall > 0:
            num_tokens = min(shortfall, side.evictable_size())
            if num_tokens > 0:
                t0 = ns()
                num_evicted_tokens += side.evict(num_tokens)
                evict_ns += ns() - t0
                num_evict_calls += 1
        last_loc = int(prefix_slots[-1]) if prefix_len else -1
        t0 = ns()
        new_slots = side.alloc(prefix_len, seq_len, last_loc)
        alloc_ns += ns() - t0
        if new_slots is None:
            side.unlock(node)
            continue
        slots = torch.cat((prefix_slots, new_slots))
        t0 = ns()
        cached_len = side.insert(i, slots)
        insert_ns += ns() - t0
        num_inserts += 1
        key_len = seq_len // page_size * page_size
        t0 = ns()
        if cached_len > prefix_len:
            side.free(slots[prefix_len:cached_len])
        if key_len < seq_len:
            side.free(slots[key_len:])
        free_ns += ns() - t0
        side.unlock(node)
        prefix_lens[i] = prefix_len
    wall_ns = ns() - wall_start
    num_prompt_tokens = sum(len(p) for p in trace.prompts)
    return ReplayResult(
        side.label,
        trace.name,
        page_size,
        prefix_lens,
        num_prompt_tokens,
        match_ns,
        insert_ns,
        evict_ns,
        alloc_ns,
        free_ns,
        num_inserts,
        num_evict_calls,
        num_evicted_tokens,
        wall_ns,
    )


def check_conservation(side: Any, capacity: int) -> None:
    """After the replay every slot is either free or in the tree, and nothing is locked."""
    side.check()
    free, tree, locked = side.available_size(), side.evictable_size(), side.protected_size()
    assert locked == 0, f"{side.label}: {locked} tokens still locked after the replay"
    assert free + tree == capacity, f"{side.label}: free {free} + tree {tree} != capacity {capacity}"


def replay_once(make_side: Any, trace: Trace, page_size: int, capacity: int) -> ReplayResult:
    side = make_side()
    result = replay(side, trace, page_size)
    check_conservation(side, capacity)
    print(
        f"{trace.name} ps={page_size} {result.label}: {result.requests_per_s:.0f} req/s, "
        f"hit rate {result.hit_rate:.2%}",
        file=sys.stderr,
    )
    return result


def median_replays(makers: list[Any], trace: Trace, page_size: int, args: argparse.Namespace) -> list[ReplayResult]:
    """Per side, the repeat with the median end-to-end time; repeats alternate between sides,
    each on a fresh cache and allocator, so a change in machine load hits both alike."""
    runs: list[list[ReplayResult]] = [[] for _ in makers]
    for _ in range(args.repeats):
        for make_side, side_runs in zip(makers, runs, strict=True):
            result = replay_once(make_side, trace, page_size, args.capacity)
            if side_runs and not np.array_equal(side_runs[0].prefix_lens, result.prefix_lens):
                raise AssertionError(f"{result.label}: hit lengths differ between repeats of {trace.name}")
            side_runs.append(result)
    return [sorted(side_runs, key=lambda r: r.wall_ns)[len(side_runs) // 2] for side_runs in runs]


# -- report ------------------------------------------------------------------------------------


def fmt_rate(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.1f}"


def results_table(results: list[ReplayResult]) -> str:
    lines = [
        "| trace | page size | cache | requests | skipped | req/s (end to end) | µs/match | µs/insert "
        "| µs/evict call | evict calls | tokens evicted | matched tokens/s | token hit rate "
        "| µs/alloc | µs/free |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        lines.append(
            f"| {r.trace} | {r.page_size} | {r.label} | {r.num_requests} | {r.num_skipped} "
            f"| {fmt_rate(r.requests_per_s)} | {r.match_us:.1f} | {r.insert_us:.1f} | {r.evict_us:.1f} "
            f"| {r.num_evict_calls} | {fmt_rate(r.num_evicted_tokens)} | {fmt_rate(r.matched_tokens_per_s)} "
            f"| {r.hit_rate:.2%} | {r.alloc_us:.1f} | {r.free_us:.1f} |"
        )
    return "\n".join(lines)


def hits_verdict(ours: ReplayResult, theirs: ReplayResult) -> str:
    if np.array_equal(ours.prefix_lens, theirs.prefix_lens):
        return "identical"
    differ = np.flatnonzero(ours.prefix_lens != theirs.prefix_lens)
    i = int(differ[0])
    return f"differ on {len(differ)} requests (first: #{i}, {ours.prefix_lens[i]} vs {theirs.prefix_lens[i]} tokens)"


def ratio_table(pairs: list[tuple[ReplayResult, ReplayResult]]) -> str:
    lines = [
        "| trace | page size | match | insert | evict (per call) | end to end (per request) "
        "| per-request hit lengths |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    for ours, theirs in pairs:
        e2e = theirs.requests_per_s / ours.requests_per_s
        lines.append(
            f"| {ours.trace} | {ours.page_size} | {ours.match_us / theirs.match_us:.2f} "
            f"| {ours.insert_us / theirs.insert_us:.2f} | {ours.evict_us / max(theirs.evict_us, 1e-9):.2f} "
            f"| {e2e:.2f} | {hits_verdict(ours, theirs)} |"
        )
    return "\n".join(lines)


def report(
    args: argparse.Namespace,
    results: list[ReplayResult],
    pairs: list[tuple[ReplayResult, ReplayResult]],
    sglang_status: str,
    run_s: float,
    load_at_start: float,
) -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    traces = ", ".join(f"`{p}`" for p in args.traces)
    parts = [
        f"- date: {now}",
        f"- command: `{command_line()}`",
        f"- machine: {machine('cpu')}",
        f"- SGLang: {sglang_status}",
        f"- load average (1 min) at the start: {load_at_start:.2f}",
        f"- traces: {traces} (written by `benchmarks/gen_traces.py`, default seed 0); capacity "
        f"{args.capacity} tokens, policy {args.policy}; each row is the median (end-to-end time) of "
        f"{args.repeats} replays, each on a fresh cache and allocator, alternating between the two "
        f"caches; whole run {run_s:.0f} s",
        "",
        results_table(results),
    ]
    if pairs:
        parts += [
            "",
            "Time ratio kvscope / SGLang per operation (below 1: kvscope is faster), same process:",
            "",
            ratio_table(pairs),
        ]
    parts += [
        "",
        "Reading the table: `µs/match` is per request, `µs/insert` per inserted request, "
        "`µs/evict call` per call (one call frees at least the shortfall, whole leaves); "
        "`matched tokens/s` is matched prefix tokens over the time spent in match_prefix; "
        "`token hit rate` is matched tokens over prompt tokens. `req/s` times the whole request, "
        "allocation and frees included, so it also compares the two allocators (`µs/alloc` per "
        "request, `µs/free` per inserted request). At page size > 1 kvscope allocates with "
        "`alloc_extend` and SGLang with `alloc` of whole pages (its alloc_extend is a Triton kernel), "
        "so `µs/alloc` is not like for like there. The protocol is in the docstring of "
        "`benchmarks/bench_radix.py`.",
    ]
    return "\n".join(parts)


ABOUT = (
    "kvscope's RadixCache replaying the shared-prefix and multi-turn traces (match, insert, evict, "
    "allocation), beside SGLang's own RadixCache in the same process when it is importable."
)


def figures(results: list[ReplayResult], pairs: list[tuple[ReplayResult, ReplayResult]]) -> list[Figure]:
    """RESULTS.md rows: kvscope's replay per trace and page size, then its time over SGLang's."""
    rows = [
        Figure(
            f"kvscope, {r.trace}, page size {r.page_size}",
            f"{fmt_rate(r.requests_per_s)} req/s end to end; µs per match {r.match_us:.1f}, insert "
            f"{r.insert_us:.1f}, evict call {r.evict_us:.1f}; token hit rate {r.hit_rate:.2%}",
        )
        for r in results
        if r.label == "kvscope"
    ]
    for ours, theirs in pairs:
        rows.append(
            Figure(
                f"kvscope / SGLang time, {ours.trace}, page size {ours.page_size}",
                f"match {ours.match_us / theirs.match_us:.2f}, insert {ours.insert_us / theirs.insert_us:.2f}, "
                f"evict call {ours.evict_us / max(theirs.evict_us, 1e-9):.2f}, end to end "
                f"{theirs.requests_per_s / ours.requests_per_s:.2f} (below 1: kvscope faster); "
                f"hit lengths {hits_verdict(ours, theirs)}",
            )
        )
    return rows


# -- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--capacity", type=int, default=200_000, help="KV pool size in tokens")
    parser.add_argument("--policy", default="lru")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1, as bench_alloc: the tensors are small)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="replays per case; the median is reported")
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="set its rows in the bench_radix table of benchmarks/RESULTS.md",
    )
    parser.add_argument("--no-sglang", action="store_true", help="skip the SGLang side even if present")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    start = time.perf_counter()
    sgl, sglang_version = (None, "skipped (--no-sglang)") if args.no_sglang else import_sglang()
    sglang_status = f"sglang {sglang_version}, run in the same process" if sgl else f"absent ({sglang_version})"
    print(f"SGLang: {sglang_status}", file=sys.stderr)
    results: list[ReplayResult] = []
    pairs: list[tuple[ReplayResult, ReplayResult]] = []
    for path in args.traces:
        trace = load_trace(path)
        keys = sglang_keys(trace) if sgl else None
        gc.collect()
        gc.freeze()  # the trace arrays stay out of every later collection
        for page_size in args.page_size:
            makers = [partial(KvscopeSide, trace, args.capacity, page_size, args.policy)]
            if sgl:
                makers.append(partial(SglangSide, sgl, keys, args.capacity, page_size, args.policy))
            pair = median_replays(makers, trace, page_size, args)
            results += pair
            if len(pair) == 2:
                pairs.append((pair[0], pair[1]))
        gc.unfreeze()
    body = report(args, results, pairs, sglang_status, time.perf_counter() - start, load_at_start)
    print(body)
    if args.write:
        load = f"load average {load_at_start:.2f} (1 min) at the start; SGLang: {sglang_status}"
        write_figures("bench_radix", ABOUT, figures(results, pairs), this_run("cpu", load))


if __name__ == "__main__":
    main()
