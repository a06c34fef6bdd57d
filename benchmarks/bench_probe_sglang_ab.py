"""Two versions of the SGLang probe's per-operation hooks and fold in one process, on SGLang 0.5.23's
real classes: CPU µs added per call, each version against plain SGLang and the new one against the old,
in paired blocks.

    git archive main kvscope/probe | tar -x -C OLD_TREE
    PYTHONPATH=. KVSCOPE_PYTHON=.venv/bin/python ~/.cache/kvscope/sglang-venv/bin/python -W ignore \\
        benchmarks/bench_probe_sglang_ab.py OLD_TREE [--blocks N] [--label TEXT] [--no-write]

OLD_TREE holds the other version's kvscope/probe/sglang.py and sglang_ledger.py (and, since they were
split from sglang.py, sglang_probe.py, sglang_hooks.py, sglang_families.py and sglang_live.py); they are
loaded as modules of their own beside this tree's (the old sglang.py on the old ones; all on this tree's
other modules), each with its own probe and recorder. NOTE: why this and not two runs of
bench_probe_sglang.py: on the shared 2-core machine the load moves between runs by more than a sub-µs
change; here plain, old and new alternate in short blocks (BLOCK_ROUNDS rounds, a new shuffled order
each of BLOCKS repetitions) in one process, and each figure is the median of the blocks' paired
differences, with their middle half. The rounds are bench_probe_sglang.py's:
    allocator  PagedTokenToKVPoolAllocator (page size 4): alloc(16) + the free of it, 2 calls a round
    tree       UnifiedRadixCache (Python core): a request's match_prefix, lock, unlock, 3 calls a round
Each round then runs its probe's per-step fold_if_due (plain: nothing), and each block ends with its
recorder's hand-off (idle(), untimed); what a block leaves queued folds in that version's next block.
Two clocks per block: the engine thread's CPU (time.thread_time) and the whole process's
(time.process_time); a version that folds on a thread of its own has that fold's CPU in its own
block's process figure (the block's end waits for the worker to finish what the block handed it).
Sets its rows in the `## bench_probe_sglang_ab` table of benchmarks/RESULTS.md (--label: which two
versions, in the rows' names).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_probe_sglang as bench  # NOTE: SGLang stand-ins installed, SGLang imported
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from benchmarks._apart import load_apart
from benchmarks._results import Figure, this_run, write_figures
from kvscope.probe import sglang as new
from kvscope.probe import sglang_hooks as new_hooks
from kvscope.probe.core import settings_from_env

BLOCK_ROUNDS = 400
HOOKS = {  # NOTE: class -> (method, the probe's factory for it)
    PagedTokenToKVPoolAllocator: (("alloc", "_d_alloc"), ("_release_page_ids", "_d_release_pages")),
    UnifiedRadixCache: (
        ("match_prefix", "_d_match"),
        ("inc_lock_ref", "_d_unified_inc_lock"),
        ("dec_lock_ref", "_d_unified_dec_lock"),
    ),
}
Modes = dict[str, tuple[dict[type, dict[str, Any]], Any]]
TARGET_US = 1.0
ABOUT = (
    "CPU µs that two versions of the SGLang probe's per-operation hooks and fold (level full) add per call of "
    "SGLang 0.5.23's real paged allocator and UnifiedRadixCache, paired in one process against plain SGLang "
    "and each other."
)


PARTS = ("sglang_ledger", "sglang_live", "sglang_probe", "sglang_hooks", "sglang_families", "sglang")  # NOTE: import
# order; before the split, sglang.py and sglang_ledger.py alone


def load_old(tree: Path) -> tuple[Any, Any]:
    """The old sglang.py, on the old tree's parts of it (sglang_ledger.py and, since the split, its state,
    hooks, families and live readers) in place of this tree's: those it has are loaded apart. Returns it
    and the module of its hook factories (sglang_hooks.py since the split, sglang.py before)."""
    sources = {
        f"kvscope.probe.{part}": (tree / f"kvscope/probe/{part}.py").read_text()
        for part in PARTS
        if (tree / f"kvscope/probe/{part}.py").is_file()
    }
    modules = load_apart(sources, "old")
    return modules["kvscope.probe.sglang"], modules.get("kvscope.probe.sglang_hooks", modules["kvscope.probe.sglang"])


def versions(old: tuple[Any, Any]) -> Modes:
    """plain, old, new: each the methods to put on the classes, and its probe (None: plain)."""
    plain = {owner: {name: owner.__dict__[name] for name, _ in pairs} for owner, pairs in HOOKS.items()}
    out: Modes = {"plain": (plain, None)}
    for tag, (module, factories) in (("old", old), ("new", (new, new_hooks))):
        module.PROBE.__init__(settings_from_env(engine="sglang"), "0.5.23")
        module.PROBE.state.active = True
        assert module.PROBE.recorder() is not None, f"the {tag} probe did not open its recorder"
        made = {
            owner: {name: getattr(factories, factory)(plain[owner][name]) for name, factory in pairs}
            for owner, pairs in HOOKS.items()
        }
        out[tag] = (made, module.PROBE)
    return out


def tree_round(tree: Any, params: Any, step: Callable[[], None]) -> None:
    for _ in range(BLOCK_ROUNDS):
        node = tree.match_prefix(params).last_device_node
        tree.unlock(tree.lock(node))
        step()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("old_tree", type=Path, help="holds the old kvscope/probe/sglang.py and sglang_ledger.py")
    parser.add_argument("--blocks", type=int, default=201, help="repetitions of each mode's block")
    parser.add_argument("--label", default="old -> new", help="which versions, for the rows' names")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args()
    if not (args.old_tree / "kvscope/probe/sglang_ledger.py").is_file():
        print(f"bench_probe_sglang_ab: no kvscope/probe/sglang_ledger.py under {args.old_tree}")
        return 2
    os.environ["KVSCOPE_CAPTURE"] = str(Path(tempfile.mkdtemp(prefix="kvscope-bench-ab-")) / "ab.db")
    os.environ["KVSCOPE_LEVEL"] = "full"  # NOTE: the per-operation hooks it compares (SGLang's default is summary)
    modes = versions(load_old(args.old_tree))
    alloc, tree = bench.build()
    ids = array("q", [*range(1000, 1048), *range(5000, 5016)])
    req = bench.Req("bench", "", ids, bench.SamplingParams(max_new_tokens=1))
    params = bench.MatchPrefixParams(key=bench.RadixKey(ids), req=req)
    rounds: dict[str, tuple[Callable[[Callable[[], None]], None], int]] = {
        "allocator": (lambda step: bench.allocator_round(alloc, step, BLOCK_ROUNDS), 2),
        "tree": (lambda step: tree_round(tree, params, step), 3),
    }
    loads = [os.getloadavg()[0]]
    us, process_us = timed_blocks(modes, rounds, args.blocks)
    loads.append(os.getloadavg()[0])
    for _, probe in modes.values():
        if probe is not None:
            probe.drain()
            probe.state.recorder.close()
    load = f"load average {loads[0]:.1f} -> {loads[1]:.1f}"
    print(f"{load}; {args.blocks} blocks of {BLOCK_ROUNDS} rounds a mode")
    figures = []
    for group in rounds:
        plain = us[(group, "plain")]
        print(f"{group}: plain {statistics.median(plain):.2f} µs per call; CPU µs added, median (middle half)")
        figures.append(Figure(f"{group} plain: SGLang's own CPU per real call", f"{statistics.median(plain):.2f} µs"))
        for label, mine, base in (("old", "old", "plain"), ("new", "new", "plain"), ("new - old", "new", "old")):
            low, mid, high = statistics.quantiles(_paired(us, group, mine, base), n=4)
            p_low, p_mid, p_high = statistics.quantiles(_paired(process_us, group, mine, base), n=4)
            print(
                f"  {label:<10} engine thread {mid:+.2f} ({low:+.2f} to {high:+.2f}), "
                f"process {p_mid:+.2f} ({p_low:+.2f} to {p_high:+.2f})"
            )
            value = (
                f"{mid:+.2f} µs (middle half {low:+.2f} to {high:+.2f}); "
                f"process {p_mid:+.2f} ({p_low:+.2f} to {p_high:+.2f})"
            )
            name = f"{group} full, {label} ({args.label}): engine-thread CPU added per real call"
            if label == "new - old":
                figures.append(Figure(name, value))
            else:
                figures.append(Figure(name, value, f"≤ {TARGET_US:g} µs", "met" if mid <= TARGET_US else "not met"))
    if not args.no_write:
        write_figures("bench_probe_sglang_ab", ABOUT, figures, this_run("cpu", load))
    return 0


def _paired(us: dict[tuple[str, str], list[float]], group: str, mine: str, base: str) -> list[float]:
    return [m - b for m, b in zip(us[(group, mine)], us[(group, base)], strict=True)]


def timed_blocks(
    modes: Modes, rounds: dict[str, tuple[Callable[[Callable[[], None]], None], int]], blocks: int
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], list[float]]]:
    """CPU µs per call of each (group, mode) block, the modes in a new shuffled order each repetition:
    the engine thread's, and the process's (its fold worker's included)."""
    us: dict[tuple[str, str], list[float]] = {}
    process_us: dict[tuple[str, str], list[float]] = {}
    order = random.Random(0)
    for _ in range(blocks):
        for group, (run, calls) in rounds.items():
            for mode in order.sample(sorted(modes), len(modes)):
                methods, probe = modes[mode]
                for owner, named in methods.items():
                    for name, method in named.items():
                        setattr(owner, name, method)
                step = (lambda p=probe: p.fold_if_due(time.monotonic())) if probe else (lambda: None)
                start, start_process = time.thread_time_ns(), time.process_time_ns()
                run(step)
                end = time.thread_time_ns()
                bench.settle(probe)
                end_process = time.process_time_ns()
                us.setdefault((group, mode), []).append((end - start) / BLOCK_ROUNDS / calls / 1e3)
                process_us.setdefault((group, mode), []).append(
                    (end_process - start_process) / BLOCK_ROUNDS / calls / 1e3
                )
                if probe is not None:
                    probe.state.recorder.idle()
    return us, process_us


if __name__ == "__main__":
    raise SystemExit(main())
