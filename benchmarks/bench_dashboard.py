"""Dashboard page loads on million-event captures: each page rendered through AppTest, cold and warm.

    .venv/bin/python benchmarks/bench_dashboard.py [--events N] [--quick] [--no-write] [--keep DIR]

Two captures of about N events each (default 1,000,000):
- engine: a real `kvscope run` of the multi-turn workload (34 requests per 1,000 events; page
  size 4, so the Memory page's page-waste view runs; 16,384 KV tokens) with
  a few injected leak-tail faults, so the Leaks page has culprits; the run stores its leak
  report at close, as every `kvscope run` does.
- synthetic: written straight through SQLRecorder to stress the tree pages: every step some
  requests arrive, match a random cached node, allocate, insert a new node under it, decode
  and finish, the oldest leaves are evicted past a budget of TREE_BUDGET_NODES nodes (a tree
  ~20x the engine run's); a usage sample per step, a tree snapshot every SNAPSHOT_EVERY steps,
  a leak check every LEAK_CHECK_EVERY steps; its leak report is stored as `kvscope run` would.
Then times each page of the real app (AppTest, the capture picked by KVSCOPE_DB): cold =
st.cache_data and st.cache_resource cleared first (opening the store, the page's SQL, chart
building and Streamlit's own work), warm =
the same page again (cached). Writes the `## bench_dashboard` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import streamlit as st
from _results import command_line, machine_lines, write_section
from streamlit.testing.v1 import AppTest

from kvscope.debug.report import build_report, save_report
from kvscope.telemetry import EventKind, EvictReason, LeakCheck, PoolName, PoolTerms, RequestRecord, UsageSample
from kvscope.telemetry.recorder import SQLRecorder

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("overview", "memory", "tree", "evictions", "leaks", "requests", "capacity")
EVENTS_PER_ENGINE_REQUEST = 29.5  # multi-turn, page size 4, 16,384 KV tokens (measured on 2,000 requests)
REQUESTS_PER_STEP = 4
DECODE_TOKENS = 8
TREE_BUDGET_NODES = 3000
SNAPSHOT_EVERY = 50
LEAK_CHECK_EVERY = 500
POOL_TOKENS = 1 << 20


def build_engine_capture(path: Path, num_events: int) -> None:
    num_requests = int(num_events / EVENTS_PER_ENGINE_REQUEST * 1.02) + 1  # a margin: at least num_events
    subprocess.run([sys.executable, "-m", "kvscope", "run", "--workload", "multi-turn", "--num-requests",
                    str(num_requests), "--seed", "1", "--page-size", "4", "--kv-tokens", "16384",
                    "--inject", "leak-tail:0.0005", "--capture", str(path)],
                   check=False, cwd=ROOT, stdout=subprocess.DEVNULL)  # exit 1: the injected leaks fail the check
    if not path.exists():
        raise SystemExit(f"kvscope run wrote no capture at {path}")


def build_synthetic_capture(path: Path, num_events: int, seed: int = 0) -> tuple[int, int]:
    """Returns (events, steps) written."""
    rng = random.Random(seed)
    nodes: dict[int, tuple[int, int]] = {0: (-1, 0)}  # node -> (parent, tokens)
    next_node, next_slot, events, step, cum = 1, 1, 0, 0, [0, 0, 0, 0, 0]
    with SQLRecorder(path, level="full", label="bench-dashboard") as rec:
        while events < num_events:
            rec.step = step
            for i in range(REQUESTS_PER_STEP):
                rid = f"r{step}-{i}"
                parent = rng.choice(list(nodes)) if len(nodes) < 64 else rng.choice(list(nodes)[-64:])
                hit, miss = nodes[parent][1], rng.randint(8, 64)
                slots = np.arange(next_slot, next_slot + miss, dtype=np.int64)
                next_slot += miss
                rec.record(EventKind.REQUEST_ARRIVE, rid=rid, num_tokens=hit + miss)
                rec.record(EventKind.MATCH, pool=PoolName.FULL, rid=rid, node_id=parent, num_tokens=hit, aux=miss)
                rec.record(EventKind.LOCK, rid=rid, node_id=parent)
                rec.record(EventKind.REQUEST_ADMIT, rid=rid, num_tokens=hit + miss)
                rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid=rid, num_tokens=miss, slots=slots)
                for _ in range(DECODE_TOKENS):
                    rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid=rid, num_tokens=1,
                               slots=np.array([next_slot], dtype=np.int64))
                    next_slot += 1
                rec.record(EventKind.INSERT, pool=PoolName.FULL, rid=rid, node_id=next_node, num_tokens=miss,
                           aux=parent, slots=slots)
                nodes[next_node] = (parent, miss)
                next_node += 1
                rec.record(EventKind.UNLOCK, rid=rid, node_id=parent)
                rec.record(EventKind.REQUEST_FINISH, rid=rid, num_tokens=DECODE_TOKENS)
                events += 8 + DECODE_TOKENS
                cum = [cum[0] + hit + miss, cum[1] + hit, cum[2] + 1, cum[3] + (hit > 0), cum[4]]
                rec.request(RequestRecord(rid, f"u{i}", hit + miss, "finished", hit, DECODE_TOKENS, 0,
                                          {"arrive": time.monotonic()}, {"arrive": step, "admit": step,
                                                                          "first_token": step, "finish": step + 1}))
            events += _evict(rec, nodes, rng, cum)
            tokens = sum(t for _, t in nodes.values())
            rec.usage(UsageSample(step, PoolTerms(POOL_TOKENS, POOL_TOKENS - tokens, tokens, 0), None, 64, 64, 0,
                                  0, *cum[:4], cum[4], 0))
            if step % SNAPSHOT_EVERY == 0:
                _snapshot(rec, step, nodes)
            if step % LEAK_CHECK_EVERY == 0:
                rec.leak_check(LeakCheck(step, "full", POOL_TOKENS, POOL_TOKENS - tokens, tokens, 0, 0, 0))
            step += 1
    save_report(path, build_report(path))
    return events, step


def _evict(rec: SQLRecorder, nodes: dict[int, tuple[int, int]], rng: random.Random, cum: list[int]) -> int:
    if len(nodes) <= TREE_BUDGET_NODES:
        return 0
    parents = {p for p, _ in nodes.values()}
    leaves = [n for n in list(nodes)[:200] if n not in parents and n != 0]
    for node in leaves[: REQUESTS_PER_STEP]:
        tokens = nodes.pop(node)[1]
        rec.record(EventKind.EVICT, pool=PoolName.FULL, node_id=node, num_tokens=tokens,
                   reason=EvictReason.CAPACITY, slots=np.arange(tokens, dtype=np.int64))
        cum[4] += tokens
    return len(leaves[: REQUESTS_PER_STEP])


def _snapshot(rec: SQLRecorder, step: int, nodes: dict[int, tuple[int, int]]) -> None:
    rows = [(n, None if p < 0 else p, t, "", 0, float(n), 1, None, False, 0) for n, (p, t) in nodes.items()]
    rec.tree_snapshot(step, rows)


def time_pages(path: Path) -> list[tuple[str, float, float]]:
    os.environ["KVSCOPE_DB"] = str(path)
    os.chdir(ROOT)
    out = []
    for page in PAGES:
        timings = []
        for cold in (True, False):
            if cold:
                st.cache_data.clear()
                st.cache_resource.clear()  # the store and the leak report too
            at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
            start = time.perf_counter()
            at.run()
            if page != "overview":
                at.switch_page(f"kvscope/dashboard/app_pages/{page}.py").run()
            timings.append(time.perf_counter() - start)
            assert not at.exception, [e.value for e in at.exception]
        out.append((page, *timings))
        print(f"{page}: cold {timings[0]:.2f} s, warm {timings[1]:.2f} s", file=sys.stderr, flush=True)
    return out


def _counts(path: Path) -> tuple[int, int, int, float]:
    import sqlite3

    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        events = conn.execute("SELECT count(*) FROM events").fetchone()[0]
        steps = conn.execute("SELECT count(*) FROM usage").fetchone()[0]
        nodes = conn.execute("SELECT max(n) FROM (SELECT count(*) AS n FROM tree_snapshots GROUP BY step)")
        nodes = nodes.fetchone()[0]
        run_s = conn.execute("SELECT max(coalesce(ended_at, heartbeat_at) - started_at) FROM runs").fetchone()[0]
    return int(events), int(steps), int(nodes or 0), float(run_s or 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="events per capture")
    parser.add_argument("--quick", action="store_true", help="100,000 events")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    parser.add_argument("--keep", type=Path, help="build the captures in this folder and keep them (reused if there)")
    parser.add_argument("--only", choices=["engine", "synthetic"], help="one capture only")
    args = parser.parse_args()
    num_events = 100_000 if args.quick else args.events
    lines = [f"Run {datetime.now(UTC):%Y-%m-%d} with `{command_line()}`.", "", *machine_lines("cpu"), "",
             "Each page is the real app through AppTest, including the app frame and the run picker; cold = "
             "Streamlit's caches (data and resources) cleared first, warm = rendered again from the caches. "
             "Target: every page ≤ 2 s.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for source in ("engine", "synthetic"):
            if args.only and source != args.only:
                continue
            path = folder / f"{source}-{num_events}.db"
            start = time.perf_counter()
            if not path.exists():
                print(f"building the {source} capture ({num_events:,} events)…", file=sys.stderr, flush=True)
                if source == "engine":
                    build_engine_capture(path, num_events)
                else:
                    build_synthetic_capture(path, num_events)
            build_s = time.perf_counter() - start
            events, steps, nodes, run_s = _counts(path)
            built = f"built in {build_s:.0f} s" if build_s > 1 else f"reused (its run took {run_s:.0f} s to record)"
            size_mib = path.stat().st_size / 2**20
            print(f"{source} capture {path}: {events:,} events, {steps:,} steps, largest tree {nodes:,} nodes, "
                  f"{built}", file=sys.stderr, flush=True)
            timings = time_pages(path)
            start = time.perf_counter()
            report = build_report(path)
            replay_s = time.perf_counter() - start
            lines += [f"**{source}**: {events:,} events over {steps:,} steps, largest tree snapshot {nodes:,} nodes, "
                      f"{size_mib:.0f} MiB, {built}.", "",
                      "| page | cold (s) | warm (s) |", "|---|---:|---:|"]
            lines += [f"| {page} | {cold:.2f} | {warm:.2f} |" for page, cold, warm in timings]
            replayed = report.through_seq + 1
            lines += ["", "The Leaks page reads the report stored at close. Without one (`--no-report`, or a run "
                      f"still running) it replays the ledger: {replay_s:.1f} s for this capture's {replayed:,} events "
                      f"({replay_s / max(replayed, 1) * 1e6:.1f} µs per event, {len(report.leaks):,} leaks found), "
                      "once; a running run then replays only its new events."]
            lines.append("")
    body = "\n".join(lines).rstrip()
    print(body)
    if not args.no_write:
        write_section("bench_dashboard", body)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
