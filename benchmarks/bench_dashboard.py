"""Dashboard page loads on a 10-million-event capture: each page rendered through AppTest, cold and warm.

    .venv/bin/python benchmarks/bench_dashboard.py [--events N] [--engine-events N] [--quick] [--no-write]
                                                    [--keep DIR] [--only synthetic|engine] [--postgres URL]

Two captures (the target is every page <= 2 s on 10,000,000 events):
- synthetic (--events, default 10,000,000): written straight through a real SQLRecorder at level
  full, about 100k events/s (the engine records ~30k/s: hours for 10M). Every step
  REQUESTS_PER_STEP requests arrive, match a recently cached node (SPLIT_SHARE of the matches end
  inside a node and split it), lock it, are admitted and allocate their prompt's missing tokens
  (one batched alloc); every running request decodes a token (one batched alloc); a request that
  ends (after 4-32 steps) inserts its slots as a new node under its match, unlocks and finishes.
  Past TREE_BUDGET_NODES nodes (or an eighth of the POOL_TOKENS pool left) the oldest unlocked
  leaves are evicted and their slots freed (one batched free), so slots, nodes and locks stay
  consistent: the ledger replay finds no leak. A usage sample per step, a tree snapshot every
  SNAPSHOT_EVERY steps, a leak check every LEAK_CHECK_EVERY steps, a requests row per request,
  page size PAGE_SIZE in the run's config; the leak report is stored as `kvscope run` does.
- engine (--engine-events, default 1,000,000; 0 skips it): a real `kvscope run` of the multi-turn
  workload (34 requests per 1,000 events; page size 4; 16,384 KV tokens) with a few injected
  leak-tail faults, so the Leaks page has culprits and the Capacity page a request stream to replay.
With --keep DIR the captures are built there (as NAME.part, renamed once complete) and reused.
With --postgres URL each capture is also copied into that PostgreSQL database (copy_capture.py; a
database that already holds runs is taken as that copy, as it is) and its pages timed there too, as
"<source> capture on PostgreSQL".
Then times each page of the real app (AppTest, the capture picked by KVSCOPE_DB): cold =
st.cache_data and st.cache_resource cleared first (opening the store, the page's reads, chart
building and Streamlit's own work), warm = the same page again (cached). Sets its rows in the
`## bench_dashboard` table of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from _pages import time_pages as time_app_pages
from _results import Figure, command_line, machine, this_run, write_figures
from copy_capture import copy_capture

from kvscope.debug.report import build_report, save_report
from kvscope.telemetry import EventKind, EvictReason, LeakCheck, PoolName, PoolTerms, RequestRecord, UsageSample
from kvscope.telemetry.recorder import SQLRecorder

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("overview", "memory", "tiers", "tree", "evictions", "leaks", "requests", "capacity")
EVENTS_PER_ENGINE_REQUEST = 29.5  # multi-turn, page size 4, 16,384 KV tokens (measured on 2,000 requests)
REQUESTS_PER_STEP = 4  # arrivals per step; each decodes 4-32 steps, so ~70 run at once
SPLIT_SHARE = 0.125  # of matches, the share that ends inside a node (a split)
TREE_BUDGET_NODES = 20_000  # past this (or with an eighth of the pool left) leaves are evicted
EVICT_PER_STEP = 6
SNAPSHOT_EVERY = 1000
LEAK_CHECK_EVERY = 500
POOL_TOKENS = 1 << 22
PAGE_SIZE = 4  # as the config says (slots are not page-aligned: only the Memory page's waste view reads it)
PROGRESS_EVERY = 500_000


def build_engine_capture(path: Path, num_events: int) -> None:
    num_requests = int(num_events / EVENTS_PER_ENGINE_REQUEST * 1.02) + 1  # a margin: at least num_events
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "run",
            "--workload",
            "multi-turn",
            "--num-requests",
            str(num_requests),
            "--seed",
            "1",
            "--page-size",
            "4",
            "--kv-tokens",
            "16384",
            "--inject",
            "leak-tail:0.0005",
            "--capture",
            str(path),
        ],
        check=False,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )  # exit 1: the injected leaks fail the check
    if not path.exists():
        raise SystemExit(f"kvscope run wrote no capture at {path}")


class _CountingRecorder(SQLRecorder):
    num_events = 0

    def record(self, kind: EventKind, **fields: Any) -> None:
        self.num_events += 1
        super().record(kind, **fields)

    def record_batch(self, kind: EventKind, *, pool: PoolName | None, rids: Any, num_tokens: Any, slots: Any) -> None:
        self.num_events += len(rids)
        super().record_batch(kind, pool=pool, rids=rids, num_tokens=num_tokens, slots=slots)


class _SyntheticTree:
    """The synthetic capture's radix tree and slot pool, kept just enough to emit events whose
    slots, nodes and locks stay consistent (the ledger replay finds no leak)."""

    def __init__(self, rec: SQLRecorder, rng: random.Random) -> None:
        self.rec, self.rng = rec, rng
        self.parent: dict[int, int] = {0: -1}
        self.slots: dict[int, np.ndarray] = {0: np.zeros(0, np.int64)}
        self.depth: dict[int, int] = {0: 0}  # tokens from the root through the node
        self.children: dict[int, int] = {0: 0}
        self.locks: dict[int, int] = {0: 0}
        self.evictable: dict[int, None] = {}  # unlocked leaves, oldest first (an ordered set)
        self.recent: list[int] = []
        self.next_node = 1
        self.free = np.arange(POOL_TOKENS, dtype=np.int64)  # NOTE: a ring: [head, head + num_free) is free
        self.head, self.num_free = 0, POOL_TOKENS
        self.cum_evicted = 0

    @property
    def cached_tokens(self) -> int:
        return POOL_TOKENS - self.num_free

    def alloc(self, num_tokens: int) -> np.ndarray:
        index = (self.head + np.arange(num_tokens)) % POOL_TOKENS
        self.head, self.num_free = (self.head + num_tokens) % POOL_TOKENS, self.num_free - num_tokens
        return self.free[index]

    def release(self, slots: np.ndarray) -> None:
        tail = (self.head + self.num_free + np.arange(len(slots))) % POOL_TOKENS
        self.free[tail] = slots
        self.num_free += len(slots)

    def pick_parent(self) -> int:
        recent = self.recent
        while recent and recent[-1] not in self.parent:
            recent.pop()
        if not recent or self.rng.random() < 0.05:
            return 0
        node = recent[-1 - self.rng.randrange(min(len(recent), 256))]
        return node if node in self.parent else 0

    def _new_node(self, parent: int, slots: np.ndarray) -> int:
        node, self.next_node = self.next_node, self.next_node + 1
        self.parent[node], self.slots[node], self.children[node], self.locks[node] = parent, slots, 0, 0
        self.depth[node] = self.depth[parent] + len(slots)
        self.children[parent] += 1
        self.evictable.pop(parent, None)
        return node

    def split(self, node: int, upper_tokens: int) -> int:
        """Cut `node`: a new upper node takes its first `upper_tokens` slots."""
        slots = self.slots[node]
        upper = self._new_node(self.parent[node], slots[:upper_tokens])
        self.children[self.parent[node]] -= 1
        self.parent[node], self.slots[node] = upper, slots[upper_tokens:]
        self.children[upper] = 1
        self.rec.record(EventKind.SPLIT, pool=PoolName.FULL, node_id=upper, num_tokens=upper_tokens, aux=node)
        return upper

    def insert(self, parent: int, slots: np.ndarray, rid: str) -> int:
        node = self._new_node(parent, slots)
        self.evictable[node] = None
        self.recent.append(node)
        if len(self.recent) > 4096:
            del self.recent[:2048]
        self.rec.record(
            EventKind.INSERT, pool=PoolName.FULL, rid=rid, node_id=node, num_tokens=len(slots), aux=parent, slots=slots
        )
        return node

    def lock(self, node: int, rid: str) -> None:
        self.locks[node] += 1
        self.evictable.pop(node, None)
        self.rec.record(EventKind.LOCK, rid=rid, node_id=node, num_tokens=self.depth[node])

    def unlock(self, node: int, rid: str) -> None:
        self.locks[node] -= 1
        if node in self.parent and node != 0 and not self.locks[node] and not self.children[node]:
            self.evictable[node] = None
        self.rec.record(EventKind.UNLOCK, rid=rid, node_id=node, num_tokens=self.depth[node])

    def evict(self, num_nodes: int) -> None:
        """Evict up to `num_nodes` of the oldest unlocked leaves, free their slots; events written."""
        freed: list[np.ndarray] = []
        for _ in range(num_nodes):
            if not self.evictable:
                break
            node = next(iter(self.evictable))
            del self.evictable[node]
            slots, parent = self.slots.pop(node), self.parent.pop(node)
            del self.depth[node], self.children[node], self.locks[node]
            self.children[parent] -= 1
            if parent and not self.children[parent] and not self.locks[parent]:
                self.evictable[parent] = None
            self.rec.record(
                EventKind.EVICT,
                pool=PoolName.FULL,
                node_id=node,
                num_tokens=len(slots),
                reason=EvictReason.CAPACITY,
                slots=slots,
            )
            freed.append(slots)
            self.cum_evicted += len(slots)
        if freed:
            self.rec.record_batch(
                EventKind.FREE,
                pool=PoolName.FULL,
                rids=[None] * len(freed),
                num_tokens=[len(s) for s in freed],
                slots=np.concatenate(freed),
            )
            for slots in freed:
                self.release(slots)

    def snapshot(self, step: int) -> None:
        rows = [
            (n, None if p < 0 else p, len(self.slots[n]), "", self.locks[n], float(n), 1, None, False, self.depth[n])
            for n, p in self.parent.items()
        ]
        self.rec.tree_snapshot(step, rows)


class _Running(NamedTuple):
    rid: str
    node: int  # the node its match ended at (locked)
    prompt_len: int
    hit_len: int
    slots: list[np.ndarray]  # its own slots: the prompt's miss, then one per decode step
    finish_step: int
    arrive_t: float


def build_synthetic_capture(
    path: Path,
    num_events: int,
    seed: int = 0,
    keep_going: Callable[[int], bool] | None = None,
    *,
    store_report: bool = True,
) -> tuple[int, int]:
    """Returns (events, steps) written. See the module docstring. `keep_going(events)`, asked every
    step: False ends the run there (bench_readers' writer, which writes until told to stop). Without
    `store_report`, no leak report is stored at the end (a live writer's hundreds of millions of events
    would take an hour to replay after the figures are in)."""
    rng = random.Random(seed)
    running: list[_Running] = []
    events, step, cum = 0, 0, [0, 0, 0, 0]  # prompt tokens, hit tokens, requests, hit requests
    next_report = PROGRESS_EVERY
    start = time.perf_counter()
    config = {"engine": {"cache": {"kind": "radix"}, "pool": {"page_size": PAGE_SIZE}}}  # the Memory page's waste view
    with _CountingRecorder(path, level="full", label="bench-dashboard", config=config) as rec:
        tree = _SyntheticTree(rec, rng)
        while events < num_events and (keep_going is None or keep_going(events)):
            rec.step = step
            admitted = [_arrive(tree, rec, rng, f"r{step}-{i}", step, cum) for i in range(REQUESTS_PER_STEP)]
            if len(tree.parent) > TREE_BUDGET_NODES or tree.num_free < POOL_TOKENS // 8:
                tree.evict(EVICT_PER_STEP)
            prefill = [r.slots[0] for r in admitted]
            rec.record_batch(
                EventKind.ALLOC,
                pool=PoolName.FULL,
                rids=[r.rid for r in admitted],
                num_tokens=[len(s) for s in prefill],
                slots=np.concatenate(prefill),
            )
            running.extend(admitted)
            decode = tree.alloc(len(running))
            rec.record_batch(
                EventKind.ALLOC,
                pool=PoolName.FULL,
                rids=[r.rid for r in running],
                num_tokens=[1] * len(running),
                slots=decode,
            )
            for r, slot in zip(running, decode, strict=True):
                r.slots.append(slot[None])
            still = []
            for r in running:
                if r.finish_step > step:
                    still.append(r)
                    continue
                tree.insert(r.node, np.concatenate(r.slots), r.rid)
                tree.unlock(r.node, r.rid)
                rec.record(EventKind.REQUEST_FINISH, rid=r.rid, num_tokens=len(r.slots) - 1)
                rec.request(
                    RequestRecord(
                        r.rid,
                        f"u{hash(r.rid) % 8}",
                        r.prompt_len,
                        "finished",
                        r.hit_len,
                        len(r.slots) - 1,
                        0,
                        {"arrive": r.arrive_t, "finish": time.monotonic()},
                        {
                            "arrive": r.finish_step - len(r.slots) + 1,
                            "admit": r.finish_step - len(r.slots) + 1,
                            "first_token": r.finish_step - len(r.slots) + 2,
                            "finish": step,
                        },
                    )
                )
            running = still
            cached = tree.cached_tokens
            rec.usage(
                UsageSample(
                    step,
                    PoolTerms(POOL_TOKENS, tree.num_free, cached, 0),
                    None,
                    256,
                    256 - len(running),
                    len(running),
                    0,
                    *cum,
                    tree.cum_evicted,
                    0,
                )
            )
            if step % SNAPSHOT_EVERY == 0:
                tree.snapshot(step)
            if step % LEAK_CHECK_EVERY == 0:
                rec.leak_check(LeakCheck(step, "full", POOL_TOKENS, tree.num_free, cached, 0, 0, 0, False))
            events = rec.num_events
            if events >= next_report:
                rate = events / (time.perf_counter() - start)
                print(
                    f"  {events:,} events, step {step:,}, {len(tree.parent):,} nodes ({rate:,.0f} events/s)",
                    file=sys.stderr,
                    flush=True,
                )
                next_report += PROGRESS_EVERY
            step += 1
        tree.snapshot(step - 1)
    if not store_report:
        return events, step
    print(
        f"  recorded {events:,} events in {time.perf_counter() - start:.0f} s; storing the leak report…",
        file=sys.stderr,
        flush=True,
    )
    save_report(path, build_report(path))
    return events, step


def _arrive(
    tree: _SyntheticTree, rec: SQLRecorder, rng: random.Random, rid: str, step: int, cum: list[int]
) -> _Running:
    """arrive, (split), match, lock, admit; the prompt's miss tokens are allocated by the caller."""
    parent = tree.pick_parent()
    miss = rng.randint(16, 256)
    rec.record(EventKind.REQUEST_ARRIVE, rid=rid, num_tokens=tree.depth[parent] + miss)
    if parent and rng.random() < SPLIT_SHARE and len(tree.slots[parent]) > 1:
        parent = tree.split(parent, rng.randrange(1, len(tree.slots[parent])))
    hit = tree.depth[parent]
    rec.record(
        EventKind.MATCH,
        pool=PoolName.FULL,
        rid=rid,
        node_id=parent,
        num_tokens=hit,
        aux=miss,
        principal=f"u{hash(rid) % 8}",
    )
    tree.lock(parent, rid)
    rec.record(EventKind.REQUEST_ADMIT, rid=rid, num_tokens=hit + miss)
    cum[0], cum[1], cum[2], cum[3] = cum[0] + hit + miss, cum[1] + hit, cum[2] + 1, cum[3] + (hit > 0)
    return _Running(rid, parent, hit + miss, hit, [tree.alloc(miss)], step + rng.randint(4, 32), time.monotonic())


def time_pages(db: Path | str, rounds: int) -> list[tuple[str, float, float]]:
    out = []
    for page, (cold, warm) in time_app_pages(str(db), PAGES, rounds).items():
        out.append((page, cold, warm))
        print(f"{page}: cold {cold:.2f} s, warm {warm:.2f} s (medians of {rounds})", file=sys.stderr, flush=True)
    return out


def _counts(path: Path) -> tuple[int, int, int, float]:
    import sqlite3

    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        events = conn.execute("SELECT count(*) FROM events").fetchone()[0] if "events" in tables else 0
        if "event_chunks" in tables:
            events += conn.execute("SELECT coalesce(sum(num_events), 0) FROM event_chunks").fetchone()[0]
        steps = conn.execute("SELECT count(*) FROM usage").fetchone()[0]
        nodes = conn.execute("SELECT max(n) FROM (SELECT count(*) AS n FROM tree_snapshots GROUP BY step)")
        nodes = nodes.fetchone()[0]
        run_s = conn.execute("SELECT max(coalesce(ended_at, heartbeat_at) - started_at) FROM runs").fetchone()[0]
    return int(events), int(steps), int(nodes or 0), float(run_s or 0.0)


def _replay_line(path: Path) -> str:
    start = time.perf_counter()
    report = build_report(path)
    replay_s = time.perf_counter() - start
    replayed = report.through_seq + 1
    return (
        "The Leaks page reads the report stored at close. Without one (`--no-report`, or a run still running) it "
        f"replays the ledger: {replay_s:.1f} s for this capture's {replayed:,} events "
        f"({replay_s / max(replayed, 1) * 1e6:.1f} µs per event, {len(report.leaks):,} leaks found), once; a "
        "running run then replays only its new events."
    )


TARGET_PAGE_S = 2.0
ABOUT = (
    "Each dashboard page's load time, cold (Streamlit's caches cleared) and warm, through the real app "
    "(AppTest) on a large synthetic capture and an engine capture."
)


def _server_copy(path: Path, url: str) -> str:
    """`url`, holding a copy of the capture at `path` (made now unless it holds runs already)."""
    from kvscope.telemetry.store import open_writer

    engine = open_writer(url)
    try:
        with engine.connect() as conn:
            copied = conn.exec_driver_sql("SELECT count(*) FROM runs").scalar_one()
    finally:
        engine.dispose()
    if not copied:
        print(f"copying {path} into the PostgreSQL database…", file=sys.stderr, flush=True)
        copy_capture(path, url)
    return url


def page_figures(
    source: str, num_events: int, timings: list[tuple[str, float, float]], *, named: bool = False
) -> list[Figure]:
    return [
        Figure(
            f"{source}, {page} page" if named else f"{source} capture, {page} page",
            f"{cold:.2f} s cold, {warm:.2f} s warm ({num_events:,} events)",
            f"≤ {TARGET_PAGE_S:g} s",
            "met" if max(cold, warm) <= TARGET_PAGE_S else "not met",
        )
        for page, cold, warm in timings
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000, help="events of the synthetic capture")
    parser.add_argument(
        "--engine-events",
        type=int,
        default=1_000_000,
        help="events of the engine capture (0: skip it; ~30k events/s to record)",
    )
    parser.add_argument("--quick", action="store_true", help="100,000 events each")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    parser.add_argument("--keep", type=Path, help="build the captures in this folder and keep them (reused if there)")
    parser.add_argument("--only", choices=["engine", "synthetic"], help="one capture only")
    parser.add_argument(
        "--postgres",
        metavar="URL",
        help="also time the pages on a copy of each capture in this PostgreSQL database (empty, or the copy)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="cold and warm renders of each page, rounds alternating the page order; medians (3)",
    )
    parser.add_argument(
        "--skip-replay",
        action="store_true",
        help="skip timing the ledger replay without a stored report (~7 min on 10M events)",
    )
    args = parser.parse_args()
    sizes = {
        "synthetic": 100_000 if args.quick else args.events,
        "engine": 100_000 if args.quick else args.engine_events,
    }
    lines = [
        f"Run {datetime.now(UTC):%Y-%m-%d} with `{command_line()}`.",
        "",
        f"- machine: {machine('cpu')}",
        "",
        "Each page is the real app through AppTest, opened directly (as from its link), including the app "
        "frame and the run picker, after one untimed render of every page (the dashboard's modules "
        "imported, as in a running dashboard); cold = "
        "Streamlit's caches (data and resources) cleared first, warm = rendered again from the caches; "
        "medians over rounds that alternate the page order. The synthetic run has one tier (a radix "
        "cache), so its Tiers page is the line saying so. Target: every page ≤ 2 s.",
        "",
    ]
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for source in ("synthetic", "engine"):
            num_events = sizes[source]
            if (args.only and source != args.only) or not num_events:
                continue
            path = folder / f"{source}-{num_events}.db"
            start = time.perf_counter()
            if not path.exists():
                print(f"building the {source} capture ({num_events:,} events)…", file=sys.stderr, flush=True)
                part = path.with_name(f"{path.name}.part")  # NOTE: renamed once complete, so --keep never reuses half
                part.unlink(missing_ok=True)
                if source == "engine":
                    build_engine_capture(part, num_events)
                else:
                    build_synthetic_capture(part, num_events)
                part.rename(path)
            build_s = time.perf_counter() - start
            events, steps, nodes, run_s = _counts(path)
            built = f"built in {build_s:.0f} s" if build_s > 1 else f"reused (its run took {run_s:.0f} s to record)"
            size_mib = path.stat().st_size / 2**20
            print(
                f"{source} capture {path}: {events:,} events, {steps:,} steps, largest tree {nodes:,} nodes, {built}",
                file=sys.stderr,
                flush=True,
            )
            timings = time_pages(path, args.rounds)
            figures += page_figures(source, events, timings)
            lines += [
                f"**{source}**: {events:,} events over {steps:,} steps, largest tree snapshot {nodes:,} nodes, "
                f"{size_mib:,.0f} MiB, {built}.",
                "",
                "| page | cold (s) | warm (s) |",
                "|---|---:|---:|",
            ]
            lines += [f"| {page} | {cold:.2f} | {warm:.2f} |" for page, cold, warm in timings]
            if not args.skip_replay:
                lines += ["", _replay_line(path)]
            lines.append("")
            if args.postgres:
                timings = time_pages(_server_copy(path, args.postgres), args.rounds)
                figures += page_figures(f"{source} capture on PostgreSQL", events, timings, named=True)
                lines += [f"**{source} on PostgreSQL** (the same runs, copied):", "", "| page | cold (s) | warm (s) |"]
                lines += ["|---|---:|---:|", *(f"| {page} | {cold:.2f} | {warm:.2f} |" for page, cold, warm in timings)]
                lines.append("")
    body = "\n".join(lines).rstrip()
    print(body)
    if not args.no_write:
        write_figures("bench_dashboard", ABOUT, figures, this_run("cpu"))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
