"""`kvscope attach`'s recorder and its bad input: the KV-event records of a real engine become
kvscope's events (insert, write, revive, evict with reasons capacity / to-host / reset, host_evict),
tree snapshots and usage rows with NULL where the source says nothing, in a schema-5 capture; a
capture older than schema 5, an unreachable URL or a bad flag is one line and exit 2, and nothing
is written."""

from __future__ import annotations

import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvscope.attach.recorder import OLD_CAPTURE, AttachRecorder, attach_ready
from kvscope.attach.scrape import EngineSample
from kvscope.attach.wire import Batch, Cleared, Removed, Stored
from kvscope.telemetry import CaptureError, Retention, SQLRecorder
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.records import PoolTerms, UsageSample
from tests.telemetry.test_schema import V1_CAPTURE

SOURCE = {
    "kind": "attach",
    "engine": "vllm",
    "version": "0.32.0",
    "url": "http://127.0.0.1:1",
    "model": "m",
    "block_size": 2,
    "capacity_tokens": 24,
    "kv_events": {"endpoint": "ipc:///x", "replay_endpoint": None, "topic": "", "bind": False},
    "warnings": [],
    "provides": ["evictions", "hit_rate", "pages", "requests.counts", "usage.used"],
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "attach", *args], capture_output=True, text=True, timeout=60
    )


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, timeout=120)


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def vllm_sample(used: int) -> EngineSample:
    return EngineSample(
        t_wall=0.0,
        capacity_tokens=24,
        available_tokens=None,
        evictable_tokens=None,
        used_tokens=used,
        host_used_tokens=None,
        host_total_tokens=None,
        num_running=0,
        num_waiting=0,
        prompt_tokens_total=10,
        cached_tokens_total=4,
        host_cached_tokens_total=None,
        evicted_tokens_total=None,
        preemptions_total=0,
    )


def stored(hashes: list[int], parent: int | None, tokens: list[int], tier: str = "device") -> Stored:
    return Stored(block_hashes=tuple(hashes), parent=parent, token_ids=tuple(tokens), block_size=2, tier=tier)


def test_the_forest_changes_become_events_and_usage_keeps_nulls(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    recorder = AttachRecorder(db, SOURCE, snapshot_every=2)
    recorder.apply(Batch(1.0, (stored([11, 12], None, [5, 6, 7, 8]), stored([13], 11, [9, 9])), None))
    recorder.tick(vllm_sample(used=6))
    recorder.apply(
        Batch(
            2.0,
            (
                stored([12], 11, [7, 8], tier="host"),  # a backup: write
                Removed(block_hashes=(12,), tier="device"),  # demoted: evict to-host
                stored([12], 11, [7, 8]),  # loaded back: revive
                Removed(block_hashes=(12,), tier="host"),  # host_evict
                Removed(block_hashes=(13,), tier="device"),  # evict capacity
                Removed(block_hashes=(99,), tier="device"),
            ),
            None,
        )
    )  # unknown: no event
    recorder.tick(vllm_sample(used=4))
    recorder.apply(Batch(3.0, (Cleared(),), None))
    recorder.close({"delivered": 3, "lost_batches": 0})

    names = ["step", "kind", "pool", "node_id", "num_tokens", "aux", "reason"]
    frame = Capture(db).events(1, limit=None, columns=names)[names]
    events = [tuple(None if pd.isna(v) else v for v in row) for row in frame.itertuples(index=False, name=None)]
    assert events == [
        (1, "insert", "full", 1, 2, 0, None),
        (1, "insert", "full", 2, 2, 1, None),
        (1, "insert", "full", 3, 2, 1, None),
        (2, "write", "host", 2, 2, 0, None),
        (2, "evict", "full", 2, 2, 0, "to-host"),
        (2, "revive", "full", 2, 2, 0, None),
        (2, "host_evict", "host", 2, 2, 0, "capacity"),
        (2, "evict", "full", 3, 2, 0, "capacity"),
        (3, "evict", "full", 1, 2, 0, "reset"),
        (3, "evict", "full", 2, 2, 0, "reset"),
    ]
    usage = rows(
        db,
        "SELECT step, full_total, full_available, full_evictable, full_used, req_total, "
        "cum_prompt_tokens, cum_hit_tokens, cum_evicted_tokens, cum_requests FROM usage ORDER BY step",
    )
    assert usage == [(1, 24, None, None, 6, None, 10, 4, 0, None), (2, 24, None, None, 4, None, 10, 4, 4, None)]
    snapshots = rows(
        db,
        "SELECT step, node_id, parent_id, num_tokens, token_preview, tier FROM tree_snapshots ORDER BY step, node_id",
    )
    assert [row for row in snapshots if row[0] == 2] == [
        (2, 0, None, 0, "", "device"),
        (2, 1, 0, 2, "5 6", "device"),
        (2, 2, 1, 2, "7 8", "device"),
    ]
    assert [row for row in snapshots if row[0] == 3] == [(3, 0, None, 0, "", "device")]  # the clear emptied it
    ((level, label),) = rows(db, "SELECT level, label FROM runs")
    assert (level, label) == ("summary", "attach vllm 0.32.0")
    ((body,),) = rows(db, "SELECT body FROM reports WHERE kind = 'attach'")
    report = json.loads(body)
    assert report["unknown_removes"] == 1 and report["resets"] == 1 and report["evictions"] == 4
    assert report["delivered"] == 3


def test_an_engine_run_writes_full_used_as_total_minus_available_minus_evictable(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with SQLRecorder(db, level="summary") as recorder:
        recorder.usage(UsageSample(1, PoolTerms(100, 60, 25, 5), None, 8, 7, 1, 0, 10, 2, 1, 1, 0, 0))
    assert rows(db, "SELECT full_used FROM usage") == [(15,)]
    attach_ready(db)  # a schema-5 file takes an attached run


def test_a_capture_older_than_schema_5_is_refused_before_anything_is_asked(tmp_path: Path) -> None:
    old = tmp_path / "v1.db"
    shutil.copy(V1_CAPTURE, old)
    upgraded = tmp_path / "upgraded.db"
    shutil.copy(V1_CAPTURE, upgraded)
    SQLRecorder(upgraded, level="summary").close()  # now says version 5, with its NOT NULL columns
    for path in (old, upgraded):
        before = path.read_bytes()
        with pytest.raises(CaptureError, match=OLD_CAPTURE):
            attach_ready(path)
        done = cli("--url", "http://127.0.0.1:9", "--capture", str(path))
        assert done.returncode == 2 and done.stderr == f"kvscope attach: error: {path}: {OLD_CAPTURE}\n"
        assert path.read_bytes() == before


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_url_is_one_line_and_makes_no_capture(tmp_path: Path) -> None:
    capture = tmp_path / "none.db"
    done = cli("--url", f"http://127.0.0.1:{free_port()}", "--capture", str(capture), "--timeout-s", "2")
    assert done.returncode == 2 and done.stderr.startswith("kvscope attach: error: ")
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert not capture.exists()


@pytest.mark.parametrize(("flag", "value"), [("--scrape-s", "0"), ("--duration-s", "nan"), ("--engine", "tgi")])
def test_a_bad_flag_is_one_line(flag: str, value: str) -> None:
    done = cli("--url", "http://127.0.0.1:9", flag, value)
    assert done.returncode == 2 and done.stderr.startswith("kvscope attach: error: ") and flag in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_diff_and_check_read_an_attached_capture_without_inventing_figures(tmp_path: Path) -> None:
    attached = tmp_path / "a.db"
    recorder = AttachRecorder(attached, SOURCE, snapshot_every=2)
    recorder.apply(Batch(1.0, (stored([11, 12], None, [5, 6, 7, 8]),), None))
    recorder.tick(vllm_sample(used=6))
    recorder.close({"delivered": 1, "lost_batches": 0})
    engine = tmp_path / "run.db"
    with SQLRecorder(engine, level="summary") as writer:
        writer.usage(UsageSample(1, PoolTerms(100, 60, 25, 5), None, 8, 7, 1, 0, 10, 2, 1, 1, 0, 0))
    out = kvscope("diff", str(attached), str(engine), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    a, b = result["a"]["metrics"], result["b"]["metrics"]
    assert (a["peak used tokens (full)"], b["peak used tokens (full)"]) == (6, 15)
    assert "hit rate (request-weighted)" not in a and b["hit rate (request-weighted)"] == 1.0  # not provided: absent
    check = kvscope("check", str(attached))
    assert check.returncode == 3, check.stdout + check.stderr  # an attached engine's leaks: not known here
    assert "an attached engine (vllm 0.32.0) runs its own leak check" in check.stdout


def test_an_attached_run_under_a_window_drops_its_oldest_events_and_keeps_its_usage(tmp_path: Path) -> None:
    """attach --keep-events: the recorder drops the oldest whole chunks (no ledger to wait for) and keeps
    the usage series (one row in ten steps past the kept events); the tree at the last snapshot still reads."""
    db = tmp_path / "a.db"
    recorder = AttachRecorder(
        db, SOURCE, snapshot_every=5, flush_interval_s=0.0, retention=Retention(keep_events_s=0.05)
    )
    recorder.sql.wait_ready()
    for tick in range(20):
        recorder.apply(Batch(float(tick), (stored([100 + tick], None, [tick, tick + 1]),), None))
        recorder.tick(vllm_sample(used=2))
        time.sleep(0.1)  # NOTE: the writer writes each tick's chunk on its own (batches that queue share one)
    recorder.close({"delivered": 20, "lost_batches": 0})
    ((first_seq, first_step, dropped_chunks),) = rows(
        db, "SELECT first_seq, first_step, dropped_chunks FROM event_retention"
    )
    assert first_seq > 0 and dropped_chunks > 0
    steps = {step for (step,) in rows(db, "SELECT step FROM usage")}  # NOTE: thinned past the kept events
    assert steps == {s for s in range(1, first_step) if s % 10 == 0} | set(range(first_step, 21))
    capture = Capture(db)
    try:
        assert int(capture.events(1, limit=None).seq.min()) == first_seq
        assert len(capture.tree_at(1, 20)) > 1
    finally:
        capture.close()
