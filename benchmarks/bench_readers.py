"""Many readers on one live capture: the writer's events/s while dashboard sessions read the run it
is writing, and how long their pages take to settle.

    .venv/bin/python benchmarks/bench_readers.py [--sessions 10] [--rounds 2] [--window-s 20] [--nice 10]
                                                 [--no-write]
    .venv/bin/python benchmarks/bench_readers.py --cold [--sessions 10] [--events 400000] [--rounds 1]
    .venv/bin/python benchmarks/bench_readers.py --refresh-cpu [--sessions 10] [--events 300000] [--rounds 8]

Live (the default), how a team watches one run: a writer records bench_dashboard.py's level-full
workload through a real SQLRecorder (a process of its own, writing as fast as it can until told to
stop) and ONE dashboard server runs beside it (`streamlit run app.py`, started by the launcher's own
command, kvscope/dashboard/launch.py, at its default niceness unless --nice says otherwise). Sessions
are websockets speaking the browser's protocol to that server (benchmarks/_sessions.py): each opens
the Overview, the live page, and follows its live panel at the panel's own refresh period, as a
browser tab does. The sessions' client is one process at nice 19, standing in for browsers on the
viewers' own machines: it parses messages and draws nothing, and its CPU time is reported. A round
measures three windows of --window-s seconds each on the same running capture, in an order that
alternates between rounds: no session, 1 session, --sessions sessions (opened --settle-s before the
window starts). Figures: the writer's events/s in a window with N sessions over its events/s alone in
the same round (target: it falls by no more than 5 %), the page's settle time (a session's first
request to the server's script_finished) and the live panel's (a rerun request to its
script_finished) with 1 and with N sessions, and the server's CPU share in each window.

--refresh-cpu, what the machine's load does not blur: the CPU seconds one live refresh costs the
dashboard's process (the real app through AppTest, sessions kept open and rerun): the first session
at a new read stamp (the reads and its own rerun) and each further session at that stamp.

--cold, the torture case kept from before: every session is a process of its own running the whole
app through AppTest, opening --pages cold in turn (Streamlit's caches cleared) as fast as it can
while the writer writes --events events; no cache is shared between sessions. Its rows are named
"cold reloads".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from _results import Figure, interval_verdict, stop_cleanly_on_sigterm, this_run, write_figures

HERE = Path(__file__).resolve().parent
ABOUT = (
    "Many dashboard sessions on one capture while a level-full writer fills it: the writer's events/s "
    "with 10 sessions reading against alone, and the pages' settle times with 1 and with 10 sessions. "
    "Live: one dashboard server, sessions following the Overview's live panel (the way a team watches "
    "a run); cold reloads: a process per session reloading pages cold (the torture case)."
)
MAX_DROP = 0.05  # NOTE: the bound on the writer's events/s falling while sessions read
PROGRESS_EVERY_S = 0.2


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


# -- live: one server, light sessions -----------------------------------------------------------


def write_until(path: Path, stop: Path) -> None:
    """In the writer's process: records until `stop` exists; a line `monotonic_s events` about every
    PROGRESS_EVERY_S on stdout."""
    from bench_dashboard import build_synthetic_capture

    last = [0.0]

    def keep_going(num_events: int) -> bool:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            print(f"{now} {num_events}", flush=True)
            last[0] = now
        return not stop.exists()

    build_synthetic_capture(path, 10**12, keep_going=keep_going, store_report=False)


class WriterProgress:
    """The writer's latest (monotonic_s, events) line, read by a thread of this process."""

    def __init__(self, writer: subprocess.Popen[str]) -> None:
        self.latest = (time.monotonic(), 0)
        self._thread = threading.Thread(target=self._read, args=(writer,), daemon=True)
        self._thread.start()

    def _read(self, writer: subprocess.Popen[str]) -> None:
        assert writer.stdout is not None
        for line in writer.stdout:
            t, events = line.split()
            self.latest = (float(t), int(events))


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def niceness(pid: int) -> set[int]:
    """The niceness of each of a process's threads."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError):
            continue
    return found


def run_client(url: str, num_sessions: int, seconds: float, out: Path) -> None:
    """In the sessions' process (nice 19): the sessions' timings and this process's CPU to `out`."""
    from _sessions import run_sessions

    os.nice(19)
    times = asyncio.run(run_sessions(url, num_sessions, seconds))
    usage = os.times()
    out.write_text(
        json.dumps(
            {
                "page_s": [t for s in times for t in s.page_s],
                "refresh_s": [t for s in times for t in s.refresh_s],
                "errors": [e for s in times for e in s.errors],
                "messages": sum(s.num_messages for s in times),
                "cpu_s": usage.user + usage.system,
            }
        )
    )


def _wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_readers: {what} within {timeout_s:.0f} s")
        time.sleep(0.2)


class Window(NamedTuple):
    events_per_s: float
    server_cpu_share: float  # NOTE: the server's CPU seconds per second of the window (1.0: one core)
    client: dict[str, Any]  # run_client's figures (empty with no session)


def one_window(
    url: str, server: int, progress: WriterProgress, num_sessions: int, args: argparse.Namespace, folder: Path
) -> Window:
    out = folder / f"client-{num_sessions}-{time.monotonic_ns()}.json"
    client = None
    if num_sessions:
        seconds = args.settle_s + args.window_s + 1
        client = subprocess.Popen(
            [sys.executable, __file__, "--client", url, str(num_sessions), str(seconds), str(out)]
        )
    time.sleep(args.settle_s)
    (t0, e0), cpu0 = progress.latest, cpu_s(server)
    time.sleep(args.window_s)
    (t1, e1), cpu1 = progress.latest, cpu_s(server)
    found: dict[str, Any] = {}
    if client is not None:
        if client.wait(timeout=120) != 0:
            raise SystemExit(f"bench_readers: the sessions' client failed (exit {client.returncode})")
        found = json.loads(out.read_text())
        if found["errors"]:
            raise SystemExit(f"bench_readers: a session met an error: {found['errors'][:3]}")
    return Window((e1 - e0) / (t1 - t0), (cpu1 - cpu0) / args.window_s, found)


def live(args: argparse.Namespace) -> list[Figure]:
    from kvscope.dashboard import launch

    cases = [0, 1, args.sessions]
    windows: dict[int, list[Window]] = {n: [] for n in cases}
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as name:
        folder = Path(name)
        db, stop = folder / "live.db", folder / "stop"
        writer = subprocess.Popen(
            [sys.executable, __file__, "--live-writer", str(db), str(stop)], stdout=subprocess.PIPE, text=True
        )
        progress = WriterProgress(writer)
        try:
            _wait_until(lambda: progress.latest[1] >= 20_000, 120, "the writer did not record 20,000 events")
            with (
                (folder / "streamlit.log").open("wb") as log,
                launch.dashboard_on(db, nice=args.nice, log=log, start_timeout_s=120) as (url, server),
            ):
                warm_args = argparse.Namespace(settle_s=15.0, window_s=1.0)
                warm = one_window(url, server.pid, progress, 1, warm_args, folder)
                server_nice = sorted(niceness(server.pid))
                print(f"warm-up: page {warm.client['page_s']}; server threads at nice {server_nice}")
                for round_no in range(args.rounds):
                    for n in cases if round_no % 2 == 0 else cases[::-1]:
                        window = one_window(url, server.pid, progress, n, args, folder)
                        windows[n].append(window)
                        print(
                            f"round {round_no + 1}, {n:2d} sessions: writer {window.events_per_s:,.0f} events/s, "
                            f"server {window.server_cpu_share:.2f} CPU, "
                            f"client {window.client.get('cpu_s', 0):.1f} CPU s"
                        )
        except RuntimeError as err:
            raise SystemExit(f"bench_readers: the dashboard: {err}") from None
        finally:
            stop.touch()
            writer.terminate()
            writer.wait(timeout=60)
    return live_figures(args, windows, "/".join(map(str, server_nice)))


def live_figures(args: argparse.Namespace, windows: dict[int, list[Window]], nice: str) -> list[Figure]:
    many = args.sessions
    live = f"live, server at nice {nice}"
    ratios = [w.events_per_s / a.events_per_s for w, a in zip(windows[many], windows[0], strict=True)]
    ratios_one = [w.events_per_s / a.events_per_s for w, a in zip(windows[1], windows[0], strict=True)]
    drop = 1 - statistics.median(ratios)
    alone = statistics.median(w.events_per_s for w in windows[0])
    verdict, interval = interval_verdict(ratios, MAX_DROP, cost_is_drop=True)
    figures = [
        Figure(
            f"{live}: writer events/s with {many} sessions on one server / alone (median of {args.rounds} rounds)",
            f"{1 - drop:.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)}; alone {alone:,.0f}/s; {interval})",
            f"≥ {1 - MAX_DROP:.2f}",
            verdict,
        ),
        Figure(
            f"{live}: writer events/s with 1 session / alone (median of {args.rounds} rounds)",
            f"{statistics.median(ratios_one):.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios_one)})",
        ),
    ]
    for n in cases_with_sessions(windows):
        pages = [t for w in windows[n] for t in w.client["page_s"]]
        refreshes = [t for w in windows[n] for t in w.client["refresh_s"]]
        server = statistics.median(w.server_cpu_share for w in windows[n])
        client = statistics.median(w.client["cpu_s"] for w in windows[n])
        label = f"{n} session{'s' if n > 1 else ''}"
        figures += [
            Figure(
                f"{live}: the Overview's settle time, opened by {label} at once",
                spread(pages) + unsettled(len(pages), n * len(windows[n]), args.settle_s + args.window_s),
            ),
            Figure(f"{live}: the live panel's settle time per refresh, {label}", spread(refreshes)),
            Figure(
                f"{live}: the dashboard server's CPU with {label} (cores; the sessions' client beside it)",
                f"{server:.2f} (client {client:.1f} CPU s per {args.settle_s + args.window_s:.0f} s window)",
            ),
        ]
    return figures


def cases_with_sessions(windows: dict[int, list[Window]]) -> list[int]:
    return [n for n in windows if n]


def unsettled(num_settled: int, num_opened: int, seconds: float) -> str:
    missing = num_opened - num_settled
    return f"; {missing} of {num_opened} opened had not settled after {seconds:.0f} s" if missing else ""


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{len(values)} sample(s){': ' + ', '.join(f'{v:.2f} s' for v in values) if values else ''}"
    return f"median {statistics.median(values):.2f} s, p90 {p90(values):.2f} s over {len(values)}"


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


# -- refresh CPU: what one live refresh costs the dashboard's process, whatever the machine's load --------


def refresh_cpu(args: argparse.Namespace) -> list[Figure]:
    """The CPU seconds (this process's, every thread: time.process_time) of an open session's rerun of
    the Overview (the real app through AppTest: a whole rerun, its live panel included) at a new read
    stamp (the first session to see it: the reads and its own rerun) and of --sessions - 1 more open
    sessions at that stamp (what each further session adds), over --rounds new stamps of a live
    capture of --events events; the writer, a process of its own, waits while a refresh is timed."""
    from _pages import open_page

    with tempfile.TemporaryDirectory(prefix="bench-readers-") as name:
        db, stop = Path(name) / "live.db", Path(name) / "stop"
        writer = subprocess.Popen([sys.executable, __file__, "--step-writer", str(db), str(stop), str(args.events)])
        try:
            _wait_until(lambda: Path(f"{stop}.ready").exists(), 600, "the writer did not write its events")
            os.environ["KVSCOPE_DB"] = str(db)
            os.chdir(HERE.parent)
            sessions = [open_page("overview") for _ in range(args.sessions)]  # NOTE: untimed: open, imports
            first, more = [], []
            for round_no in range(args.rounds):
                Path(f"{stop}.{round_no}").touch()  # NOTE: the writer writes a few steps: a new stamp
                _wait_until(Path(f"{stop}.{round_no}.done").exists, 60, "the writer did not step")
                time.sleep(1.1)  # NOTE: the step's flush, and the run list (so the stamp) is cached for a second
                start = time.process_time()
                sessions[0].run()
                first.append(time.process_time() - start)
                start = time.process_time()
                for session in sessions[1:]:
                    session.run()
                more.append((time.process_time() - start) / (args.sessions - 1))
        finally:
            stop.touch()
            writer.wait(timeout=120)
    return [
        Figure(
            f"live refresh CPU, {args.events:,}-event capture: the first session's rerun at a new stamp",
            spread(first),
        ),
        Figure(
            f"live refresh CPU, {args.events:,}-event capture: each further session's rerun at that stamp",
            spread(more),
        ),
    ]


def step_writer(path: Path, stop: Path, num_events: int) -> None:
    """In the writer's process: `num_events` events, then a few steps each time `{stop}.N` appears."""
    from bench_dashboard import build_synthetic_capture

    asked = [0]

    def keep_going(events: int) -> bool:
        if events < num_events:
            return True
        if not Path(f"{stop}.ready").exists():
            Path(f"{stop}.ready").touch()
        while not stop.exists():
            if Path(f"{stop}.{asked[0]}").exists():
                Path(f"{stop}.{asked[0]}.done").touch()  # NOTE: after this step's flush (0.2 s)
                asked[0] += 1
                return True
            time.sleep(0.05)
        return False

    build_synthetic_capture(path, 10**12, keep_going=keep_going, store_report=False)


def write_steps(given: list[str]) -> None:
    step_writer(Path(given[0]), Path(given[1]), int(given[2]))


def cold(args: argparse.Namespace) -> list[Figure]:
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
    return [
        Figure(
            f"cold reloads (a process per session): writer events/s with {args.sessions} sessions / alone "
            f"(median of {args.rounds} rounds)",
            f"{1 - drop:.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)}; alone {alone:,.0f}/s)",
            f"≥ {1 - MAX_DROP:.2f}",
            "met" if drop <= MAX_DROP else "not met",
        ),
        *(
            Figure(
                f"cold reloads (a process per session): a page's time ({', '.join(pages)}) with {n} "
                f"session{'s' if n > 1 else ''}",
                f"median {statistics.median(t):.2f} s, p90 {p90(t):.2f} s over {len(t)} loads",
            )
            for n, t in times.items()
            if len(t) >= 2
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10, help="the many sessions (default 10)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=20.0, help="live: the seconds each case is measured")
    parser.add_argument("--settle-s", type=float, default=8.0, help="live: sessions open this long before a window")
    parser.add_argument("--nice", type=int, default=None, help="live: the server's niceness (default: the launcher's)")
    parser.add_argument("--cold", action="store_true", help="the cold-reload torture case instead (see above)")
    parser.add_argument("--refresh-cpu", action="store_true", help="the CPU of one live refresh instead (see above)")
    parser.add_argument("--events", type=int, default=400_000, help="--cold: events the writer writes per capture")
    parser.add_argument("--pages", default="overview,requests", help="--cold: pages each session opens in turn")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    parser.add_argument("--writer", nargs=2, metavar=("DB", "EVENTS_OR_STOP"), help=argparse.SUPPRESS)
    parser.add_argument("--step-writer", nargs=3, metavar=("DB", "STOP", "EVENTS"), help=argparse.SUPPRESS)
    parser.add_argument("--live-writer", nargs=2, metavar=("DB", "STOP"), help=argparse.SUPPRESS)
    parser.add_argument("--reader", nargs=4, metavar=("DB", "DONE", "PAGES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=4, metavar=("URL", "SESSIONS", "SECONDS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        print(write_capture(Path(args.writer[0]), int(args.writer[1])))
        return
    if args.step_writer:
        write_steps(args.step_writer)
        return
    if args.live_writer:
        write_until(Path(args.live_writer[0]), Path(args.live_writer[1]))
        return
    if args.reader:
        db, done, pages, out = args.reader
        read_until(Path(db), Path(done), pages.split(","), Path(out))
        return
    if args.client:
        url, sessions, seconds, out = args.client
        run_client(url, int(sessions), float(seconds), Path(out))
        return
    # NOTE: the bench's own process only: its child writers end at once on the terminate() that stops them
    # (with this handler, a live writer closed its recorder instead, replaying 212 M events for the leak report)
    stop_cleanly_on_sigterm()
    if args.sessions < 2 or args.events < 10_000 or args.rounds < 1 or args.window_s < 1:
        parser.error("--sessions is at least 2, --events at least 10,000, --rounds at least 1, --window-s at least 1")
    figures = cold(args) if args.cold else refresh_cpu(args) if args.refresh_cpu else live(args)
    for figure in figures:
        print(f"{figure.name}: {figure.value}")
    if not args.no_write:
        extra = f"{args.events:,} events per capture" if args.cold else live_load(args)
        write_figures("bench_readers", ABOUT, figures, this_run(extra=extra))


def live_load(args: argparse.Namespace) -> str:
    return (
        f"live: one dashboard server at nice {args.nice if args.nice is not None else 'default'}, "
        f"a level-full writer flat out, {args.window_s:.0f} s windows"
    )


if __name__ == "__main__":
    main()
