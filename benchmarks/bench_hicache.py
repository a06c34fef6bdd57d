"""What the host tier buys: the hiradix cache against the radix cache at the same device capacity
on the multi-turn workload through the engine, per write policy, and the CacheController's copy
bandwidth on this machine.

    .venv/bin/python benchmarks/bench_hicache.py [--quick] [--num-requests 400] [--kv-tokens TOKENS]
        [--open-conversations 16] [--repeats 3] [--no-write]

Prints Markdown tables; with --write (the default) also sets its rows in the `## bench_hicache`
table of benchmarks/RESULTS.md. One torch intra-op thread throughout (`torch.set_num_threads(1)`),
device cpu, recording off, model MODEL_PRESETS["tiny"] (float32).

NOTE: engine runs. The trace is `generate("multi-turn", num_requests=N, seed=0,
max_open_conversations=C)` (the other options at their defaults); with the default C = 4 the
live conversations fit any pool that fits a batch, so C = 16 (--open-conversations) makes the
open contexts outgrow the device pool. The trace is submitted in waves of WAVE requests, each
run to its idle point (engine.run per wave, as tests/engine/test_hiradix_engine.py), so a later
turn of a conversation arrives after the earlier one finished and can hit it. Every
configuration runs on a fresh Engine with the same device pool (--kv-tokens, default
a quarter of the working set: the tokens of the open conversations' contexts at their
peak, the largest sum over the trace of the contexts of the conversations begun and not yet
finished); hiradix adds a host pool of host_ratio x the device pool. Figures:
    hit rate        cached prompt tokens at first admission / prompt tokens (EngineStats); a
                    host hit loaded back at admission counts as cached
    prefill         prompt tokens - cached tokens: the prompt tokens the model computed (a
                    retracted request's re-prefill not included; retractions are shown)
    loaded back     HiRadixCache.num_load_back_tokens: host -> device copies at admission
    written         HiRadixCache.num_write_tokens: device -> host copies (write-through at
                    insertion or first hit, write-back at eviction)
    wall            engine.run over every wave, Engine construction untimed; median of rounds
Rounds run every configuration once, in an order rotated by one each round (after one untimed
warm-up run of the last configuration). The hit rates and counters are deterministic: every
round must give the same, else the script stops.

NOTE: bandwidth. A CacheController over a device pool (device cpu) and an unpinned host pool
of the same shape; per batch size B, an operation copies B scattered slots (a random
permutation) of every layer's K and V: write = device -> host (CacheController.write, then
writing_check), load = host -> device (load, then loading_check); the slots each hands back
are freed, untimed. bytes/s = B x bytes per token (all layers, K and V) / seconds of the
call; median over rounds that alternate write and load. On the CPU every copy is a
synchronous index_select + index_copy_; on CUDA the host pool is pinned and the copies run
over PCIe on the controller's stream, which this machine (no GPU) does not measure.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple

import _results
import numpy as np
import torch
from _results import command_line, machine, this_run, write_figures

from kvscope.app import to_engine_requests
from kvscope.cache.hiradix import HiRadixCache
from kvscope.engine.config import WRITE_POLICIES, CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.mem.cache_controller import CacheController
from kvscope.mem.host_pool import HostKVPool, HostTokenAllocator
from kvscope.mem.kv_pool import MHATokenToKVPool
from kvscope.mem.token_allocator import TokenToKVPoolAllocator
from kvscope.workloads import TraceRequest, generate

MODEL = MODEL_PRESETS["tiny"]
WAVE = 8
MAX_RUNNING = 8
CHUNK = 64
HOST_RATIOS = (2.0, 4.0)
BATCHES = (64, 512, 4096)


class Shape(NamedTuple):
    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize


SHAPES = (
    Shape(
        "tiny (4 layers x 2 heads x 16, float32)",
        MODEL.num_layers,
        MODEL.num_kv_heads,
        MODEL.head_dim,
        MODEL.torch_dtype,
    ),
    Shape("large (4 layers x 32 heads x 128, bfloat16)", 4, 32, 128, torch.bfloat16),
)


class Config(NamedTuple):
    label: str
    cache: CacheConfig


class Figures(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    loaded_back: int
    written: int
    evicted: int
    retractions: int


def configs(ratios: tuple[float, ...]) -> list[Config]:
    out = [Config("radix", CacheConfig(kind="radix"))]
    for ratio in ratios:
        for policy in WRITE_POLICIES:
            out.append(
                Config(
                    f"hiradix {policy}, host x{ratio:g}",
                    CacheConfig(kind="hiradix", write_policy=policy, host_ratio=ratio),
                )
            )  # type: ignore[arg-type]
    return out


def working_set(trace: list[TraceRequest]) -> int:
    """Peak over the trace of the summed contexts (prompt + output) of the conversations begun
    and not yet at their last turn, in trace order."""
    last_turn: dict[str, int] = {}
    for t in trace:
        conv, turn = t.rid.rsplit("-t", 1)
        last_turn[conv] = max(last_turn.get(conv, 0), int(turn))
    live: dict[str, int] = {}
    peak = 0
    for t in trace:
        conv, turn = t.rid.rsplit("-t", 1)
        live[conv] = len(t.prompt_ids) + t.output_len
        peak = max(peak, sum(live.values()))
        if int(turn) == last_turn[conv]:
            del live[conv]
    return peak


def engine_config(kv_tokens: int, cache: CacheConfig) -> EngineConfig:
    pool = PoolConfig(kv_size_tokens=kv_tokens, max_running_requests=MAX_RUNNING, max_context_len=2048)
    return EngineConfig(pool=pool, cache=cache, scheduler=SchedulerConfig(chunked_prefill_size=CHUNK), device="cpu")


def run_once(kv_tokens: int, config: Config, trace: list[TraceRequest]) -> tuple[Figures, float]:
    gc.collect()
    engine = Engine(engine_config(kv_tokens, config.cache), MODEL)
    reqs = to_engine_requests(trace)
    start_s = time.perf_counter()
    for i in range(0, len(reqs), WAVE):
        engine.run(reqs[i : i + WAVE])
    wall_s = time.perf_counter() - start_s
    stats = engine.stats
    if stats.num_finished != len(reqs) or stats.leak_checks_failed or not stats.leak_checks_passed:
        raise AssertionError(
            f"{config.label}: {stats.num_finished}/{len(reqs)} finished, leak checks "
            f"{stats.leak_checks_passed} passed, {stats.leak_checks_failed} failed"
        )
    cache = engine.memory.cache
    loaded, written = (
        (cache.num_load_back_tokens, cache.num_write_tokens) if isinstance(cache, HiRadixCache) else (0, 0)
    )
    figures = Figures(
        stats.prompt_tokens, stats.cached_tokens, loaded, written, stats.evicted_tokens, stats.num_retractions
    )
    return figures, wall_s


def run_engines(
    kv_tokens: int, cfgs: list[Config], trace: list[TraceRequest], num_rounds: int, progress: Callable[[str], None]
) -> tuple[dict[str, Figures], dict[str, list[float]]]:
    figures: dict[str, Figures] = {}
    times: dict[str, list[float]] = {c.label: [] for c in cfgs}
    run_once(kv_tokens, cfgs[-1], trace)  # warm-up, untimed
    progress("engine warm-up")
    for r in range(num_rounds):
        k = r % len(cfgs)
        for c in cfgs[k:] + cfgs[:k]:
            got, wall_s = run_once(kv_tokens, c, trace)
            if figures.setdefault(c.label, got) != got:
                raise AssertionError(f"{c.label}: round {r + 1} gave {got}, an earlier round {figures[c.label]}")
            times[c.label].append(wall_s)
        progress(f"engine round {r + 1}/{num_rounds}")
    return figures, times


# -- bandwidth ---------------------------------------------------------------------------------


def controller(shape: Shape, size: int) -> CacheController:
    device_alloc = TokenToKVPoolAllocator(size, "cpu")
    device_kv = MHATokenToKVPool(size, 1, shape.dtype, shape.kv_heads, shape.head_dim, shape.num_layers, "cpu")
    for buf in (*device_kv.k_buffer, *device_kv.v_buffer):
        buf.normal_()
    host_alloc = HostTokenAllocator(size, 1)
    host_kv = HostKVPool(shape.num_layers, shape.kv_heads, shape.head_dim, shape.dtype, size, pin_memory=False)
    for buf in (*host_kv.k_buffer, *host_kv.v_buffer):
        buf.normal_()
    return CacheController(device_alloc, device_kv, host_alloc, host_kv)


def bandwidth(
    shape: Shape, batches: tuple[int, ...], num_rounds: int, seed: int = 0
) -> dict[tuple[int, str], list[float]]:
    """Seconds per operation, per (batch, "write" | "load")."""
    size = 2 * max(batches)
    ctl = controller(shape, size)
    rng = np.random.default_rng(seed)
    out: dict[tuple[int, str], list[float]] = {(b, d): [] for b in batches for d in ("write", "load")}
    op_id = 0

    def write(batch: int) -> float:
        nonlocal op_id
        # device slots 1..size (slot 0 is the padding row): the controller only reads them
        dev = torch.from_numpy(rng.choice(np.arange(1, size + 1), batch, replace=False).astype(np.int64))
        op_id += 1
        start = time.perf_counter()
        host = ctl.write(dev, op_id)
        assert ctl.writing_check() == [op_id]
        elapsed = time.perf_counter() - start
        assert host is not None
        ctl.host_allocator.free(host)
        return elapsed

    def load(batch: int) -> float:
        nonlocal op_id
        host = rng.choice(np.arange(size), batch, replace=False).astype(np.int64)
        op_id += 1
        start = time.perf_counter()
        dev = ctl.load(host, op_id)
        assert ctl.loading_check() == [op_id]
        elapsed = time.perf_counter() - start
        assert dev is not None
        ctl.device_allocator.free(dev)
        return elapsed

    ops = {"write": write, "load": load}
    for batch in batches:  # warm-up
        write(batch)
        load(batch)
    for r in range(num_rounds):
        order = ("write", "load") if r % 2 == 0 else ("load", "write")
        for batch in batches if r % 2 == 0 else tuple(reversed(batches)):
            for direction in order:
                out[(batch, direction)].append(ops[direction](batch))
    return out


# -- report ------------------------------------------------------------------------------------


def fmt_bytes_per_s(rate: float) -> str:
    for scale, suffix in ((1 << 30, "GiB/s"), (1 << 20, "MiB/s"), (1 << 10, "KiB/s")):
        if rate >= scale:
            return f"{rate / scale:.2f} {suffix}"
    return f"{rate:.0f} B/s"


def engine_table(cfgs: list[Config], figures: dict[str, Figures], times: dict[str, list[float]]) -> list[str]:
    base = figures["radix"]
    base_rate = base.cached_tokens / base.prompt_tokens
    base_wall = statistics.median(times["radix"])
    lines = [
        "| cache | hit rate | gain vs radix | prefill tokens | loaded back | written to host | evicted "
        "| retractions | wall (median) | wall vs radix | walls (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cfgs:
        f = figures[c.label]
        rate = f.cached_tokens / f.prompt_tokens
        wall = statistics.median(times[c.label])
        walls = ", ".join(f"{t:.2f}" for t in times[c.label])
        lines.append(
            f"| {c.label} | {rate:.1%} | {(rate - base_rate) * 100:+.1f} pp | "
            f"{f.prompt_tokens - f.cached_tokens:,} | {f.loaded_back:,} | {f.written:,} | {f.evicted:,} | "
            f"{f.retractions} | {wall:.2f} s | {wall / base_wall - 1:+.0%} | {walls} |"
        )
    return lines


def bandwidth_table(shape: Shape, seconds: dict[tuple[int, str], list[float]]) -> list[str]:
    lines = [
        f"{shape.name}: {shape.bytes_per_token:,} bytes per token (every layer, K and V)",
        "",
        "| batch (tokens) | bytes per op | write (device -> host) | load (host -> device) | write µs/op | load µs/op |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    batches = sorted({b for b, _ in seconds})
    for b in batches:
        num_bytes = b * shape.bytes_per_token
        w, ld = statistics.median(seconds[(b, "write")]), statistics.median(seconds[(b, "load")])
        lines.append(
            f"| {b:,} | {num_bytes / (1 << 20):,.2f} MiB | {fmt_bytes_per_s(num_bytes / w)} | "
            f"{fmt_bytes_per_s(num_bytes / ld)} | {w * 1e6:,.0f} | {ld * 1e6:,.0f} |"
        )
    return lines


ABOUT = (
    "What the host tier buys on multi-turn at one device capacity: hit rate and wall time of radix "
    "against hiradix (three write policies, host x2 and x4), and CacheController's copy bandwidth (CPU)."
)


def result_rows(
    cfgs: list[Config], figures: dict[str, Figures], times: dict[str, list[float]], bw: list[Any]
) -> list[_results.Figure]:
    """RESULTS.md rows: each cache's hit rate and wall time, then each shape and batch's bandwidth."""
    base = figures["radix"].cached_tokens / figures["radix"].prompt_tokens
    base_wall = statistics.median(times["radix"])
    rows = []
    for c in cfgs:
        rate = figures[c.label].cached_tokens / figures[c.label].prompt_tokens
        wall = statistics.median(times[c.label])
        value = f"{rate:.1%} ({(rate - base) * 100:+.1f} pp), wall {wall:.2f} s ({wall / base_wall - 1:+.0%})"
        rows.append(_results.Figure(f"hit rate and wall time, {c.label}", value))
    for shape, seconds in bw:
        for b in sorted({b for b, _ in seconds}):
            num_bytes = b * shape.bytes_per_token
            w, ld = statistics.median(seconds[(b, "write")]), statistics.median(seconds[(b, "load")])
            rows.append(
                _results.Figure(
                    f"copy bandwidth, {shape.name}, batch of {b:,} tokens",
                    f"write {fmt_bytes_per_s(num_bytes / w)}, load {fmt_bytes_per_s(num_bytes / ld)}",
                )
            )
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds (development)")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--open-conversations", type=int, default=16, help="max_open_conversations of the trace")
    parser.add_argument(
        "--kv-tokens", type=int, default=None, help="device pool (default: a quarter of the working set)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of the engine runs")
    parser.add_argument("--bandwidth-repeats", type=int, default=9)
    parser.add_argument("--host-ratios", type=float, nargs="+", default=list(HOST_RATIOS))
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="set its rows in the bench_hicache table of benchmarks/RESULTS.md (default: on)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    num_requests = 120 if args.quick else args.num_requests
    num_rounds = 1 if args.quick else args.repeats
    bw_rounds = 3 if args.quick else args.bandwidth_repeats
    load_avg, start = os.getloadavg()[0], time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    trace = generate(
        "multi-turn",
        num_requests=num_requests,
        seed=0,
        vocab_size=MODEL.vocab_size,
        max_open_conversations=args.open_conversations,
    )
    num_prompt = sum(len(t.prompt_ids) for t in trace)
    peak = working_set(trace)
    longest = max(len(t.prompt_ids) + t.output_len for t in trace)
    kv_tokens = args.kv_tokens or peak // 4
    cfgs = configs(tuple(args.host_ratios))
    figures, times = run_engines(kv_tokens, cfgs, trace, num_rounds, progress)
    bw = []
    for shape in SHAPES:
        bw.append((shape, bandwidth(shape, BATCHES, bw_rounds)))
        progress(f"bandwidth {shape.name}")
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    rates = {c.label: figures[c.label].cached_tokens / figures[c.label].prompt_tokens for c in cfgs}
    sizing = "given" if args.kv_tokens else "a quarter of the working set"
    body = "\n".join(
        [
            f"- date: {now}",
            f"- command: `{command_line()}`",
            f"- machine: {machine('cpu')}",
            f"- load average (1 min) at the start: {load_avg:.2f}; whole run {time.perf_counter() - start:.0f} s",
            f"- workload: multi-turn, {len(trace):,} requests, seed 0, "
            f"max_open_conversations {args.open_conversations} "
            f"(other options default), {num_prompt:,} prompt tokens, longest request {longest} tokens; working set "
            f"(peak of the open conversations' contexts) {peak:,} tokens",
            f"- engine: model tiny, cpu, recording off, device pool {kv_tokens:,} tokens ({sizing}), page size 1, "
            f"{MAX_RUNNING} request rows, prefill chunks of {CHUNK}, LRU; the trace in waves of {WAVE} requests, "
            "each run to its idle point; host pool = host ratio x device pool",
            "",
            "### Hit rate at the same device capacity, per write policy",
            "",
            *engine_table(cfgs, figures, times),
            "",
            f"Hit rates and token counters are deterministic: identical in each of the {num_rounds} "
            "rounds (the script checks). Wall: median of the rounds, configurations in an order rotated by "
            f"one each round. Best gain over radix: {(max(rates.values()) - rates['radix']) * 100:+.1f} pp "
            f"({max(rates, key=rates.__getitem__)}).",
            "",
            "### CacheController copy bandwidth (CPU, synchronous)",
            "",
        ]
    )
    for shape, seconds in bw:
        body += "\n" + "\n".join(bandwidth_table(shape, seconds)) + "\n"
    body += (
        "\n" + f"Median of {bw_rounds} rounds, write and load alternating (order flipped each round), "
        "scattered slots. No GPU here: the CUDA path (pinned host pool, copies over PCIe on the controller's "
        "stream) is not measured.\n"
    )
    print(body)
    if args.write:
        run = this_run("cpu", f"load average {load_avg:.2f} (1 min) at the start")
        write_figures("bench_hicache", ABOUT, result_rows(cfgs, figures, times, bw), run)


if __name__ == "__main__":
    main()
