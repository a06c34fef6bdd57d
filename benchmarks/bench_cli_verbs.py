"""The reading verbs on a large capture: `check`, `report leaks`, `diff` (the run against itself) and
`runs`, each a fresh `kvscope` process, timed wall-clock and in CPU seconds (user + system).

    .venv/bin/python benchmarks/bench_cli_verbs.py CAPTURE [--rounds N] [--no-write]

CAPTURE is a closed `full` capture whose leak report was stored at close (as `kvscope run` and
bench_dashboard.py --keep leave it): `check` and `report leaks` read that report (docs/cli.md), and
`check --replay` is not timed (a replay costs ~6-11 µs of CPU per event: about an hour on 100 M events). Each
verb runs once untimed first (the capture's pages in the OS cache, and the page check of a large file
done and remembered, as for any verdict after the first); the figures are the medians of --rounds.
CPU seconds are reported beside wall-clock because a shared machine's load stretches the latter.
Sets its rows in the `## bench_cli_verbs` table of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import Figure, this_run, write_figures

ROOT = Path(__file__).resolve().parents[1]
TARGET_CHECK_S = 10.0  # issue 41: `check` on a capture whose report was stored
ABOUT = (
    "The reading verbs (`check`, `report leaks`, `diff`, `runs`) on a large capture whose leak report "
    "was stored at close: wall-clock and CPU seconds per fresh process."
)


def verbs(capture: str) -> dict[str, list[str]]:
    return {
        "check": ["check", capture],
        "report leaks": ["report", "leaks", capture],
        "diff (the run against itself)": ["diff", capture, capture],
        "runs": ["runs", capture],
    }


def timed(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one `kvscope ARGV` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvscope", *argv], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1, 3):
        raise SystemExit(f"kvscope {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", help="a closed full capture with its leak report stored")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each verb; medians (3)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args = parser.parse_args()
    size_gb = Path(args.capture).stat().st_size / 1e9 if Path(args.capture).exists() else None
    figures = []
    for name, argv in verbs(args.capture).items():
        timed(argv)  # NOTE: untimed: see the module docstring
        runs = [timed(argv) for _ in range(args.rounds)]
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        size = f" ({size_gb:.1f} GB file)" if size_gb and size_gb >= 0.1 else ""
        value = f"{wall:.2f} s wall, {cpu:.2f} s CPU{size}"
        print(f"{name}: {value}", flush=True)
        target = f"≤ {TARGET_CHECK_S:g} s" if name == "check" else ""
        met = ("met" if wall <= TARGET_CHECK_S else "not met") if target else "no target"
        figures.append(Figure(f"{name}, {Path(args.capture).name}", value, target, met))
    if not args.no_write:
        write_figures("bench_cli_verbs", ABOUT, figures, this_run("cpu"))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
