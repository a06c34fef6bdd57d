"""The ledger replay behind a leak report (kvscope.debug.report.build_report on a `full` capture with no
stored report): what `kvscope run` pays at close to store the report, what `check` pays on a live run
and the Leaks page on a running one. Times this tree's build_report against an older tree's on the
same capture, in fresh processes, rounds alternating old and new; both reports must be equal.

    .venv/bin/python benchmarks/bench_replay.py CAPTURE --before DIR [--rounds N] [--no-write]

CAPTURE: a closed full capture (bench_dashboard.py --keep DIR --only synthetic builds one). DIR: a
checkout of the older code (`git worktree add --detach DIR COMMIT`). Wall-clock and CPU seconds
(user + system, of the process) per replayed event, medians of --rounds; CPU is the figure to
compare on a shared machine, whose load stretches wall-clock. Sets its rows in the
`## bench_replay` table of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _results import Figure, this_run, write_figures

ROOT = Path(__file__).resolve().parents[1]
TARGET_SPEEDUP = 3.0  # issue 41.2's task: several times faster
ABOUT = (
    "The ledger replay that builds a leak report (build_report without a stored report), this tree "
    "against an older one on the same capture: seconds per replayed event, wall-clock and CPU."
)
ONE_BUILD = """
import dataclasses, hashlib, json, sys, time
from kvscope.debug.report import build_report
start, cpu = time.perf_counter(), time.process_time()
report = build_report(sys.argv[1])
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
fields = dataclasses.asdict(report)
fields.pop("stored_at")
digest = hashlib.sha256(json.dumps(fields, default=int, sort_keys=True).encode()).hexdigest()
print(json.dumps({"wall": wall, "cpu": cpu, "events": report.through_seq + 1, "digest": digest}))
"""


def one_build(tree: Path, capture: Path) -> dict:
    """build_report on `capture` in a fresh process importing kvscope from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", ONE_BUILD, str(capture)], capture_output=True, text=True, env=env, cwd=tree
    )
    if done.returncode:
        raise SystemExit(f"build_report under {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", type=Path, help="a closed full capture")
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the older code")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of old and new; medians (3)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args = parser.parse_args()
    if not args.capture.is_file() or not (args.before / "kvscope").is_dir():
        raise SystemExit("bench_replay: CAPTURE must be a file and --before a checkout holding kvscope/")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for index in range(args.rounds):
        order = ("before", "after") if index % 2 == 0 else ("after", "before")
        for side in order:
            got = one_build(args.before if side == "before" else ROOT, args.capture)
            runs[side].append(got)
            per = 1e6 / got["events"]
            print(
                f"round {index + 1}, {side}: {got['wall'] * per:.2f} µs/event wall, {got['cpu'] * per:.2f} CPU",
                flush=True,
            )
    digests = {got["digest"] for side in runs.values() for got in side}
    if len(digests) != 1:
        raise SystemExit("bench_replay: the two trees' reports differ")
    events = runs["after"][0]["events"]
    wall = {side: statistics.median(g["wall"] for g in got) * 1e6 / events for side, got in runs.items()}
    cpu = {side: statistics.median(g["cpu"] for g in got) * 1e6 / events for side, got in runs.items()}
    speedup = cpu["before"] / cpu["after"]
    value = (
        f"{cpu['after']:.2f} µs CPU per event, {wall['after']:.2f} µs wall (before: {cpu['before']:.2f} µs CPU, "
        f"{wall['before']:.2f} µs wall): {speedup:.1f}x less CPU; {events:,} events, medians of {args.rounds} "
        "alternating rounds, equal reports"
    )
    print(value)
    figure = Figure(
        f"ledger replay (build_report), {args.capture.name}",
        value,
        f"≥ {TARGET_SPEEDUP:g}x less CPU than {args.before.name}",
        "met" if speedup >= TARGET_SPEEDUP else "not met",
    )
    if not args.no_write:
        write_figures("bench_replay", ABOUT, [figure], this_run("cpu"))


if __name__ == "__main__":
    main()
