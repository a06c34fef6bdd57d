"""Many writers into one PostgreSQL database at once: the write rate, every run's events intact, and the
dashboard's reads on one of those runs.

    .venv/bin/python benchmarks/bench_postgres.py [--url URL] [--writers 8] [--events 1000000] [--rounds 3]
                                                  [--no-write]

Without --url it starts a throwaway cluster on loopback (tests/postgres_cluster.py: initdb and pg_ctl,
under the `postgres` user when run as root) and removes it afterwards; with --url it makes a new database
on that server (the role must be allowed to create one) and leaves it there.

NOTE: what it does
    write      --writers processes, started together, each records --events events into its own run through
               SQLRecorder's normal path (record() -> its writer process -> the server), level full: per
               step EVENTS_PER_STEP events (alloc of 1-8 slots, match, free of the same slots, match: a clean
               ledger, so the stored leak report is small), one usage row, one request row; events/s = all
               events / (the first record -> the last close() returned)
    check      per run, from the server: the chunks' event counts add up to --events with no gap or overlap
               in their seqs; the events read back (seq, kind, rid, num_tokens) are exactly those recorded,
               once each; the run reads 'finished'
    reads      the dashboard's Overview, Memory and Fleet pages (the real app through AppTest, the capture picked
               by KVSCOPE_DB = the URL, the newest run shown; the writers' runs are one fleet's ranks, with routed
               requests and a tree snapshot of shared and own page hashes every SNAPSHOT_EVERY_STEPS steps), cold
               (Streamlit's caches cleared) and warm, medians of --rounds; target ≤ 2 s each
Sets its rows in the `## bench_postgres` table of benchmarks/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import sys
import time
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # NOTE: tests.postgres_cluster (the throwaway cluster)

from _pages import time_pages  # noqa: E402
from _results import Figure, Run, command_line, machine, now, write_figures  # noqa: E402

EVENTS_PER_STEP = 1_000
PAGES = ("overview", "memory", "fleet")
SNAPSHOT_EVERY_STEPS = 100  # NOTE: a tree snapshot of SNAPSHOT_NODES nodes, 4 pages each, every so many steps
SNAPSHOT_NODES = 64
SLOTS = [np.arange(k, dtype=np.int64) for k in range(1, 9)]


def snapshot_rows(index: int, step: int) -> list[Any]:
    """A replica's tree at a step: SNAPSHOT_NODES chains of 4 pages; half the chains are shared by every
    replica (the same page hashes), half are this replica's own, so the Fleet page has duplication to count."""
    from kvscope.telemetry import NodeRow

    rows = []
    for node in range(SNAPSHOT_NODES):
        owner = 0 if node % 2 == 0 else index + 1
        hashes = b"".join((owner * 1_000_003 + node * 7 + page).to_bytes(8, "little") for page in range(4))
        rows.append(NodeRow(node + 1, 0, 64, "", 0, float(step), 1, None, False, 64, page_hashes=hashes))
    return rows


def record_run(url: str, index: int, num_events: int, start_at: float, writers: int, fleet_id: str, done: Any) -> None:
    """One writer process: its run's events through SQLRecorder, then the times it started and ended. Its run
    is rank `index` of a fleet of `writers` (the keys `kvscope serve --dp-size` writes), its requests routed."""
    from kvscope.telemetry import EventKind, PoolName, PoolTerms, RequestRecord, Routing, UsageSample
    from kvscope.telemetry.recorder import SQLRecorder

    time.sleep(max(0.0, start_at - time.time()))
    began = time.time()
    kinds = (EventKind.ALLOC, EventKind.MATCH, EventKind.FREE, EventKind.MATCH)
    fleet = {"id": fleet_id, "rank": index, "size": writers, "dispatch": "round_robin"}
    recorder = SQLRecorder(url, level="full", label=f"writer-{index}", config={"fleet": fleet})
    for first in range(0, num_events, EVENTS_PER_STEP):
        step = first // EVENTS_PER_STEP
        recorder.step = step
        rid = f"w{index}-r{step}"
        for i in range(first, min(num_events, first + EVENTS_PER_STEP)):
            kind = kinds[i & 3]
            slots = (
                SLOTS[(i >> 2) & 7] if kind in (EventKind.ALLOC, EventKind.FREE) else None
            )  # NOTE: freed as allocated
            recorder.record(kind, pool=PoolName.FULL, rid=rid, node_id=i & 1023, num_tokens=i & 7, slots=slots)
        recorder.usage(UsageSample(step, PoolTerms(4096, 1024, 2048, 1024), None, 64, 32, 8, 4, step, 0, step, 0, 0, 0))
        routing = Routing("round_robin", step & 31, step & 63)
        recorder.request(
            RequestRecord(rid, None, 64, "finished", 0, 8, 0, {"arrive": time.monotonic()}, {"arrive": step}, routing)
        )
        if step % SNAPSHOT_EVERY_STEPS == 0:
            recorder.tree_snapshot(step, snapshot_rows(index, step))
    recorder.close()
    done.put((index, recorder.run_id, began, time.time(), recorder.failure))


def write_all(url: str, writers: int, num_events: int) -> tuple[float, list[tuple[int, int, float, float, Any]]]:
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    start_at = time.time() + 5.0  # NOTE: every process imports first, then they start together
    fleet_id = secrets.token_hex(8)
    processes = [
        context.Process(target=record_run, args=(url, i, num_events, start_at, writers, fleet_id, done))
        for i in range(writers)
    ]
    for process in processes:
        process.start()
    results = [done.get() for _ in processes]
    for process in processes:
        process.join()
        assert process.exitcode == 0, process.exitcode
    began, ended = min(r[2] for r in results), max(r[3] for r in results)
    return ended - began, sorted(results)


def check_runs(url: str, results: list[tuple[int, int, float, float, Any]], num_events: int) -> list[str]:
    """Every run's events are there once each, as recorded; lines saying what was checked."""
    from kvscope.telemetry.queries import Capture
    from kvscope.telemetry.schema import event_chunks

    kinds = np.array(["alloc", "match", "free", "match"])
    seqs = np.arange(num_events)
    capture = Capture(url)
    try:
        runs = capture.runs().set_index("id")
        for index, run_id, _began, _ended, failure in results:
            assert failure is None, failure
            assert runs.loc[run_id, "display_status"] == "finished", runs.loc[run_id]
            c = event_chunks.c
            chunks = capture.read_frame(
                event_chunks.select().where(c.run_id == run_id).order_by(c.first_seq)
            )  # NOTE: no gap, no overlap between chunks
            assert int(chunks.num_events.sum()) == num_events
            assert list(chunks.first_seq) == [0, *np.cumsum(chunks.num_events)[:-1].tolist()]
            events = capture.events(run_id, limit=None, columns=["seq", "kind", "rid", "num_tokens"])
            assert np.array_equal(events.seq.to_numpy(), seqs), f"run {run_id}: seqs"
            assert np.array_equal(events.kind.to_numpy(dtype=str), kinds[seqs & 3]), f"run {run_id}: kinds"
            assert np.array_equal(events.num_tokens.to_numpy(), seqs & 7), f"run {run_id}: num_tokens"
            rids = np.char.add(f"w{index}-r", (seqs // EVENTS_PER_STEP).astype(str))
            assert np.array_equal(events.rid.to_numpy(dtype=str), rids), f"run {run_id}: rids"
    finally:
        capture.close()
    return [
        f"{len(results)} runs, each finished with {num_events:,} events in {len(chunks)} chunks (the last run's "
        "count): seqs 0..N-1 once each, chunks without gap or overlap, kind / request / num_tokens of every "
        "event as recorded"
    ]


def store_leak_report(url: str, run_id: int) -> float:
    """The leak report `kvscope run` builds and stores when its run closes (the Overview reads its verdict from
    it; without one it replays the run's whole ledger); seconds it took."""
    from kvscope.debug import build_report, save_report

    start = time.perf_counter()
    save_report(url, build_report(url, run_id))
    return time.perf_counter() - start


def found_the_fleet(page: str, at: Any) -> None:
    """The Fleet page found the writers' fleet (not "No fleet in this capture")."""
    if page == "fleet":
        assert any("replicas" in c.value for c in at.caption), [c.value for c in at.caption]


@contextmanager
def server(url: str | None) -> Any:
    """A new database on the server at `url`, or on a throwaway cluster; its URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    from tests import postgres_cluster

    with ExitStack() as stack:
        if url is None:
            bin_dir = postgres_cluster.find_bin_dir() or postgres_cluster.install_server()
            cluster = postgres_cluster.create(bin_dir)
            stack.callback(lambda: postgres_cluster.shutil.rmtree(cluster.root, ignore_errors=True))
            postgres_cluster.start(cluster)
            stack.callback(postgres_cluster.stop, cluster, "immediate")
            postgres_cluster.create_database(cluster)
            url = cluster.url
        name = f"bench_{secrets.token_hex(4)}"
        with psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(False), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        yield make_url(url).set(database=name).render_as_string(hide_password=False)


TARGET_PAGE_S = 2.0
ABOUT = (
    "Writer processes recording into one PostgreSQL at once (events/s, every event checked back), and "
    "the Overview, Memory and Fleet pages' load times on that fleet."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a PostgreSQL server (default: a throwaway cluster on loopback)")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--events", type=int, default=1_000_000, help="events per writer")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the page timings")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args()
    with server(args.url) as url:
        print(f"writing {args.writers} x {args.events:,} events", file=sys.stderr, flush=True)
        wall_s, results = write_all(url, args.writers, args.events)
        total = args.writers * args.events
        rate = total / wall_s
        print(f"{total:,} events in {wall_s:.1f} s: {rate:,.0f} events/s", file=sys.stderr, flush=True)
        checked = check_runs(url, results, args.events)
        print("checked: " + checked[0], file=sys.stderr, flush=True)
        report_s = store_leak_report(url, max(r[1] for r in results))
        print(f"leak report of the newest run built and stored in {report_s:.1f} s", file=sys.stderr, flush=True)
        pages = time_pages(url, PAGES, args.rounds, check=found_the_fleet)
        for page, (cold, warm) in pages.items():
            print(f"{page}: cold {cold:.2f} s, warm {warm:.2f} s", file=sys.stderr, flush=True)
    import psycopg

    body = "\n".join(
        [
            f"Run {datetime.now(UTC):%Y-%m-%d} with `{shown_command_line(args.url)}`.",
            "",
            f"- machine: {machine('cpu')}",
            f"- PostgreSQL: {server_version(args.url)}, psycopg {psycopg.__version__} "
            f"({'a throwaway cluster on loopback, fsync off' if args.url is None else 'the server at --url'})",
            "",
            f"{args.writers} writer processes started together, each recording {args.events:,} events (level full, "
            "SQLRecorder's normal path: the recording process buffers, its writer process packs and writes) into "
            "one database; the write rate is all events over the time from the first record to the last close.",
            "",
            "| writers | events each | events in all | wall (s) | events/s |",
            "|---:|---:|---:|---:|---:|",
            f"| {args.writers} | {args.events:,} | {total:,} | {wall_s:.1f} | {rate:,.0f} |",
            "",
            f"Checked: {checked[0]}.",
            "",
            f"Dashboard pages on the newest of those runs (the real app through AppTest, KVSCOPE_DB = the URL; "
            f"medians of {args.rounds} rounds; target ≤ 2 s), with the run's leak report stored as `kvscope run` "
            f"stores it when its run closes (built from the server and stored there in {report_s:.1f} s; without it "
            "the Overview replays the whole ledger of the run for its verdict). The writers' runs are the ranks of "
            f"one fleet (routed requests, a tree snapshot of {SNAPSHOT_NODES} page-hashed nodes every "
            f"{SNAPSHOT_EVERY_STEPS} steps), so the Fleet page reads all {args.writers} of them:",
            "",
            "| page | cold (s) | warm (s) |",
            "|---|---:|---:|",
            *(f"| {page} | {cold:.2f} | {warm:.2f} |" for page, (cold, warm) in pages.items()),
        ]
    )
    print(body)
    if not args.no_write:
        rows = [
            Figure(
                f"{args.writers} writers x {args.events:,} events into one PostgreSQL, level full",
                f"{rate:,.0f} events/s ({wall_s:.1f} s wall); every event checked back",
            ),
            *(
                Figure(
                    f"{page} page on that fleet",
                    f"{cold:.2f} s cold, {warm:.2f} s warm",
                    f"≤ {TARGET_PAGE_S:g} s",
                    "met" if max(cold, warm) <= TARGET_PAGE_S else "not met",
                )
                for page, (cold, warm) in pages.items()
            ),
        ]
        run = Run(now(), shown_command_line(args.url), machine("cpu", extra=f"PostgreSQL {server_version(args.url)}"))
        write_figures("bench_postgres", ABOUT, rows, run)


def shown_command_line(url: str | None) -> str:
    """The command line, with --url's password hidden."""
    from kvscope.telemetry.store import display_name

    return command_line() if url is None else command_line().replace(url, display_name(url))


def server_version(url: str | None) -> str:
    from tests import postgres_cluster

    bin_dir = postgres_cluster.find_bin_dir()
    return f"{bin_dir.parent.name}" if url is None and bin_dir is not None else "see --url"


if __name__ == "__main__":
    main()
