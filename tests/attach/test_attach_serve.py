"""`kvscope attach` as a real subprocess against `kvscope serve` (a real subprocess publishing SGLang's
KV-event stream on ipc://): it discovers the server and its stream by itself, records while prompts
that share prefixes run and force evictions, and after SIGTERM its capture holds, at the quiet end,
exactly the pages serve's own radix cache holds (serve's capture, closed after it), the evictions
serve recorded, and serve's /metrics counters as usage.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope.attach.scrape import read_samples
from kvscope.attach.scrape import total as metric_total
from kvscope.telemetry import EventKind
from kvscope.telemetry.queries import Capture
from tests.server.serving import Server, serving

PAGE_SIZE = 4
KV_TOKENS = 160  # 40 pages: the prompts below need more, so serve evicts
SCRAPE_S = 0.3
STOP_TIMEOUT_S = 60.0


@contextmanager
def serving_kv_events(tmp: Path) -> Iterator[Server]:
    """`kvscope serve` at level full, publishing its KV events on ipc:// (short paths under /tmp)."""
    ipc = Path(os.path.realpath("/tmp")) / f"kvs-attach-{os.getpid()}-{tmp.name}"
    ipc.mkdir(exist_ok=True)
    config = {
        "publisher": "zmq",
        "endpoint": f"ipc://{ipc}/kv.sock",
        "replay_endpoint": f"ipc://{ipc}/replay.sock",
        "topic": "kv",
    }
    try:
        with serving(
            tmp / "serve.db",
            "--page-size",
            str(PAGE_SIZE),
            "--kv-tokens",
            str(KV_TOKENS),
            "--level",
            "full",
            "--kv-events-config",
            json.dumps(config),
        ) as server:
            yield server
    finally:
        for leftover in ipc.iterdir():
            leftover.unlink()
        ipc.rmdir()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("attach-serve")
    with serving_kv_events(tmp) as server:
        yield server, tmp


class Attached:
    """`python -m kvscope attach` running; its stderr lines gathered."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvscope", "attach", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.err.append(line)

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.err):
                return
            assert self.process.poll() is None, f"attach ended: {''.join(self.err)}"
            time.sleep(0.1)
        raise AssertionError(f"attach never printed {text!r}: {''.join(self.err)}")

    def stop(self) -> tuple[int, str, str]:
        self.process.send_signal(signal.SIGTERM)
        out, _ = self.process.communicate(timeout=STOP_TIMEOUT_S)
        self._reader.join(5)
        return self.process.returncode, out, "".join(self.err)


def complete(url: str, prompt: list[int]) -> None:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": "kvscope-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def wait_idle(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = read_samples(httpx.get(f"{url}/metrics", timeout=10).text)
        if metric_total(samples, "sglang:num_running_reqs") == metric_total(samples, "sglang:num_queue_reqs") == 0:
            time.sleep(1.0)  # one more stats interval: idle-looking stats may predate the last requests
            return
        time.sleep(0.2)
    raise AssertionError("the server did not go idle")


def prompts() -> list[list[int]]:
    """Three families sharing a 24-token system prompt each, with distinct tails; 30 prompts of 40-60
    tokens overflow the 160-token pool many times."""
    rng = random.Random(17)
    systems = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(3, 500) for _ in range(rng.randrange(16, 37))] for i in range(30)]


def rows(db: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def last_snapshot(db: Path, run_id: int) -> list[tuple[Any, ...]]:
    ((step,),) = rows(db, "SELECT max(step) FROM tree_snapshots WHERE run_id = ?", run_id)
    return rows(
        db,
        "SELECT node_id, parent_id, num_tokens, token_preview, tier FROM tree_snapshots WHERE run_id = ? AND step = ?",
        run_id,
        step,
    )


def page_chains(snapshot: list[tuple[Any, ...]]) -> set[tuple[int, ...]]:
    """Every page's full token prefix, rebuilt from the snapshot (a page's preview holds all its tokens)."""
    by_id = {row[0]: row for row in snapshot}
    chains = set()
    for node_id, _, num_tokens, _, _ in snapshot:
        if node_id == 0:
            continue
        tokens: list[int] = []
        node = node_id
        while node:
            _, parent, n, preview, _ = by_id[node]
            page = [int(t) for t in preview.split()]
            assert len(page) == n == PAGE_SIZE
            tokens = page + tokens
            node = parent
        assert num_tokens == PAGE_SIZE
        chains.add(tuple(tokens))
    return chains


def test_a_bad_event_endpoint_is_one_line(served: tuple[Server, Path]) -> None:
    server, tmp = served
    capture = tmp / "bad.db"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "attach",
            "--url",
            server.url,
            "--kv-events",
            "nonsense://where",
            "--capture",
            str(capture),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines[-1].startswith(
        "kvscope attach: error: cannot subscribe to KV events at 'nonsense://where'"
    ), done.stderr
    assert "Traceback" not in done.stderr and not capture.exists()


def test_duration_ends_a_finished_run_with_a_json_summary(served: tuple[Server, Path]) -> None:
    server, tmp = served
    capture = tmp / "short.db"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "attach",
            "--url",
            server.url,
            "--capture",
            str(capture),
            "--scrape-s",
            "0.2",
            "--duration-s",
            "1.5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "finished" and summary["ended"] == "--duration-s 1.5 reached"
    assert summary["source"]["engine"] == "kvscope" and summary["stream"]["bad_messages"] == 0
    ((status, error),) = rows(capture, "SELECT status, error FROM runs")
    ((ticks,),) = rows(capture, "SELECT count(*) FROM usage")
    assert (status, error) == ("finished", None) and ticks == summary["ticks"] >= 5


def test_attach_records_what_serve_caches(served: tuple[Server, Path]) -> None:
    server, tmp = served
    capture = tmp / "attach.db"
    attached = Attached("--url", server.url, "--capture", str(capture), "--scrape-s", str(SCRAPE_S))
    try:
        attached.wait_for("capture ")
        time.sleep(1.0)  # NOTE: the SUB socket connects asynchronously; the replay fills what it missed anyway
        sent = prompts()
        for prompt in sent:
            complete(server.url, prompt)
        wait_idle(server.url)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        time.sleep(4 * SCRAPE_S)  # a few ticks at the quiet point
        code, out, err = attached.stop()
    finally:
        if attached.process.poll() is None:
            attached.process.kill()
    assert code == 0, err
    assert "kvscope attach: kvscope" in err and "events ipc://" in err and "Traceback" not in err
    assert "ended             stopped by SIGTERM" in out and "0 lost" in out

    # a second attach sees the server go away: a warning per failed scrape, then one line, exit 1
    gone = Attached("--url", server.url, "--capture", str(tmp / "gone.db"), "--scrape-s", "0.2", "--timeout-s", "1")
    try:
        gone.wait_for("capture ")
        serve_code, _ = server.stop()
        gone.process.wait(STOP_TIMEOUT_S)
        gone._reader.join(5)
    finally:
        if gone.process.poll() is None:
            gone.process.kill()
    assert serve_code == 0
    assert gone.process.returncode == 1, gone.err
    assert sum("warning: scrape" in line for line in gone.err) == 5 and "Traceback" not in "".join(gone.err)
    ((gone_status, gone_error),) = rows(tmp / "gone.db", "SELECT status, error FROM runs")
    assert gone_status == "interrupted" and gone_error.startswith("the server stopped answering (5 scrapes")
    serve_db = server.capture
    assert serve_db is not None

    # the run: an attached source, level summary, its config says what it is
    ((label, level, status, config),) = rows(capture, "SELECT label, level, status, config FROM runs")
    source = json.loads(config)["source"]
    assert label == "attach kvscope" and level == "summary" and status == "finished"  # SIGTERM: the normal stop
    assert source["kind"] == "attach" and source["engine"] == "kvscope" and source["block_size"] == PAGE_SIZE
    assert source["capacity_tokens"] == KV_TOKENS and source["kv_events"]["topic"] == "kv"
    assert {"pages", "evictions", "usage.split", "hit_rate"} <= set(source["provides"])

    # the pages at the quiet end == serve's radix cache at its close (serve's own capture)
    snapshot = last_snapshot(capture, 1)
    ((serve_run,),) = rows(serve_db, "SELECT max(id) FROM runs")
    serve_nodes = last_snapshot(serve_db, serve_run)
    serve_tokens = sum(row[2] for row in serve_nodes if row[0] != 0)
    assert serve_tokens % PAGE_SIZE == 0 and serve_tokens > 0
    assert len(snapshot) - 1 == serve_tokens // PAGE_SIZE
    assert all(row[4] == "device" for row in snapshot if row[0] != 0)
    for chain in page_chains(snapshot):  # every page spells a prefix of a prompt that was sent
        assert any(tuple(prompt[: len(chain)]) == chain for prompt in sent), chain

    # the evictions: one evict event per page serve evicted
    evicted_tokens = int(Capture(serve_db).events(serve_run, kinds=[EventKind.EVICT], limit=None).num_tokens.sum())
    evicts = list(
        Capture(capture)
        .events(1, kinds=[EventKind.EVICT], limit=None, columns=["num_tokens", "reason", "pool"])[
            ["num_tokens", "reason", "pool"]
        ]
        .itertuples(index=False, name=None)
    )
    assert evicted_tokens and len(evicts) == evicted_tokens // PAGE_SIZE
    assert {(n, reason, pool) for n, reason, pool in evicts} == {(PAGE_SIZE, "capacity", "full")}
    inserts = len(Capture(capture).events(1, kinds=[EventKind.INSERT], limit=None, columns=["seq"]))
    assert inserts == len(snapshot) - 1 + len(evicts)

    # usage: serve's own counters, the split known
    last = rows(
        capture,
        "SELECT full_total, full_available, full_evictable, full_used, cum_prompt_tokens, "
        "cum_hit_tokens, cum_evicted_tokens, req_total FROM usage WHERE run_id = 1 "
        "ORDER BY step DESC LIMIT 1",
    )[0]
    total, available, evictable, used, prompt_tokens, hit_tokens, evicted, req_total = last
    assert total == KV_TOKENS and evictable == serve_tokens and used == total - available - evictable
    assert metric_total(read_samples(metrics), "sglang:prompt_tokens_total") == prompt_tokens
    assert hit_tokens > 0 and evicted == evicted_tokens and req_total is None

    # the stream's counters, stored for the dashboard
    ((body,),) = rows(capture, "SELECT body FROM reports WHERE run_id = 1 AND kind = 'attach'")
    report = json.loads(body)
    assert report["lost_batches"] == 0 and report["bad_messages"] == 0 and report["delivered"] > 0
    assert report["unknown_removes"] == 0 and report["evictions"] == len(evicts)
