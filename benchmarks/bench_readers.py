"""Many readers on one live capture: the dashboard's page time with 1 and with 10 sessions reading a
run while it is written, and the writer's events/s while they read.

    .venv/bin/python benchmarks/bench_readers.py [--sessions 10] [--events 400000] [--rounds 2]
                                                 [--pages overview,requests] [--no-write]

A round writes one synthetic capture (bench_dashboard.py's level-full workload through a real
SQLRecorder, in a process of its own) three times, in an order that alternates between rounds:
alone, with 1 reading session and with --sessions of them. A session is a process of its own
running the real app (AppTest) on the capture while it is written: it opens --pages in turn,
each cold (Streamlit's caches cleared: the store, the reads, the charts), as a live page re-reads
a growing run, until the writer is done. Figures: the writer's events/s with N sessions over its
events/s alone in the same round (target: it falls by no more than 5 %), and the median and the
90th percentile of one page's time with 1 and with N sessions.

NOTE: every session is a process (a Streamlit server runs sessions as threads of one process, which
shares the page caches between them: this is the harder case, with no cache shared). On a machine
with fewer cores than sessions + 1 the sessions and the writer share the CPU, and the writer's
events/s says so: the machine line gives the cores and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import Figure, this_run, write_figures

HERE = Path(__file__).resolve().parent
ABOUT = (
    "Many dashboard sessions on one capture while a level-full writer fills it: the writer's events/s "
    "with 10 sessions reading against alone, and a page's time with 1 and with 10 sessions."
)
MAX_DROP = 0.05  # NOTE: the bound on the writer's events/s falling while sessions read


def write_capture(path: Path, num_events: int) -> float:
    """In this process (the writer's): the synthetic capture; returns its events/s."""
    from bench_dashboard import build_synthetic_capture

    start = time.perf_counter()
    written, _ = build_synthetic_capture(path, num_events)
    return written / (time.perf_counter() - start)


def read_until(db: Path, done: Path, pages: list[str], out: Path) -> None:
    """In a session's process: open each page cold in turn until `done` exists; page times to `out`."""
    import streamlit as st
    from _pages import open_page

    os.environ["KVSCOPE_DB"] = str(db)
    os.chdir(HERE.parent)
    for page in pages:  # NOTE: untimed, before the capture exists: a session's first render imports the page's modules
        open_page(page)
    Path(f"{out}.ready").touch()
    while not db.exists():
        time.sleep(0.05)
    times: list[tuple[str, float]] = []
    while not done.exists():
        for page in pages:
            st.cache_data.clear()
            st.cache_resource.clear()
            start = time.perf_counter()
            at = open_page(page)
            if at.exception:
                raise SystemExit(f"{page}: {[e.value for e in at.exception]}")
            times.append((page, time.perf_counter() - start))
    out.write_text(json.dumps(times))


def one_case(folder: Path, num_sessions: int, num_events: int, pages: list[str]) -> tuple[float, list[float]]:
    """The writer's events/s and every page time of its sessions, for one capture."""
    db, done = folder / f"live-{num_sessions}.db", folder / f"done-{num_sessions}"
    script = str(Path(__file__).resolve())
    outs = [folder / f"r{num_sessions}-{i}.json" for i in range(num_sessions)]
    readers = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                "--reader",
                str(db),
                str(done),
                ",".join(pages),
                str(out),
            ]
        )
        for out in outs
    ]
    deadline = time.monotonic() + 600
    while not all(Path(f"{out}.ready").exists() for out in outs):  # NOTE: every session warmed up first
        if time.monotonic() > deadline or any(reader.poll() not in (None, 0) for reader in readers):
            raise SystemExit("the reading sessions did not start")
        time.sleep(0.1)
    try:
        writer = subprocess.run(
            [sys.executable, script, "--writer", str(db), str(num_events)], capture_output=True, text=True, check=True
        )
    finally:
        done.touch()
    for reader in readers:
        if reader.wait(timeout=600) != 0:
            raise SystemExit(f"a reading session failed (exit {reader.returncode})")
    times = [t for out in outs for _, t in json.loads(out.read_text())]
    return float(writer.stdout.strip().splitlines()[-1]), times


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10, help="the many sessions (default 10)")
    parser.add_argument("--events", type=int, default=400_000, help="events the writer writes per capture")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pages", default="overview,requests", help="pages each session opens in turn")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    parser.add_argument("--writer", nargs=2, metavar=("DB", "EVENTS"), help=argparse.SUPPRESS)
    parser.add_argument("--reader", nargs=4, metavar=("DB", "DONE", "PAGES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        print(write_capture(Path(args.writer[0]), int(args.writer[1])))
        return
    if args.reader:
        db, done, pages, out = args.reader
        read_until(Path(db), Path(done), pages.split(","), Path(out))
        return
    if args.sessions < 2 or args.events < 10_000 or args.rounds < 1:
        parser.error("--sessions is at least 2, --events at least 10,000, --rounds at least 1")
    pages = [p for p in args.pages.split(",") if p]
    cases = [0, 1, args.sessions]
    rates: dict[int, list[float]] = {n: [] for n in cases}
    times: dict[int, list[float]] = {n: [] for n in cases}
    for round_no in range(args.rounds):
        for n in cases if round_no % 2 == 0 else cases[::-1]:
            with tempfile.TemporaryDirectory(prefix="bench-readers-") as folder:
                rate, page_times = one_case(Path(folder), n, args.events, pages)
            rates[n].append(rate)
            times[n] += page_times
            print(f"round {round_no + 1}, {n:2d} sessions: writer {rate:,.0f} events/s, {len(page_times)} page loads")
    ratios = [many / alone for many, alone in zip(rates[args.sessions], rates[0], strict=True)]
    drop = 1 - statistics.median(ratios)
    alone = statistics.median(rates[0])
    figures = [
        Figure(
            f"writer events/s with {args.sessions} sessions reading / alone (median of {args.rounds} rounds)",
            f"{1 - drop:.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)}; alone {alone:,.0f}/s)",
            f"≥ {1 - MAX_DROP:.2f}",
            "met" if drop <= MAX_DROP else "not met",
        ),
        *(
            Figure(
                f"a page's time ({', '.join(pages)}, cold) with {n} session{'s' if n > 1 else ''} reading",
                f"median {statistics.median(t):.2f} s, p90 {p90(t):.2f} s over {len(t)} loads",
            )
            for n, t in times.items()
            if len(t) >= 2
        ),
    ]
    for figure in figures:
        print(f"{figure.name}: {figure.value}")
    if not args.no_write:
        write_figures("bench_readers", ABOUT, figures, this_run(extra=f"{args.events:,} events per capture"))


if __name__ == "__main__":
    main()
