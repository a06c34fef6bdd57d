"""`kvscope attach --max-size` end to end: a real attach subprocess against a real `kvscope serve`
publishing its KV events, under a size bound the recorded pages outgrow. The capture stays within its
bound, keeps every usage row's thinned series, and attach's summary and `kvscope runs` say what was
dropped (docs/captures.md, "Retention")."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.attach.test_attach_serve import Attached, complete, rows, serving_kv_events, wait_idle
from tests.server.serving import Server

BOUND_BYTES = 256 * 1024  # NOTE: an empty capture takes about 132 KiB; the pass starts at 80% of the bound
MAX_ROUNDS = 40  # NOTE: rounds of 30 prompts until the bound has made the writer drop (each round ~1-3 s)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("attach-bound")
    with serving_kv_events(tmp) as server:
        yield server, tmp


def dropped_events(capture: Path) -> int:
    if not capture.exists():
        return 0
    conn = sqlite3.connect(f"file:{capture}?mode=ro", uri=True)
    try:
        found = conn.execute("SELECT first_seq FROM event_retention").fetchone()
    except sqlite3.OperationalError:
        return 0
    finally:
        conn.close()
    return 0 if found is None else int(found[0])


def used_bytes(capture: Path) -> int:
    conn = sqlite3.connect(capture)
    try:
        pages, free, size = (
            conn.execute(f"PRAGMA {name}").fetchone()[0] for name in ("page_count", "freelist_count", "page_size")
        )
    finally:
        conn.close()
    return (pages - free) * size


def test_attach_under_a_size_bound_stays_within_it_and_says_what_it_dropped(served: tuple[Server, Path]) -> None:
    server, tmp = served
    capture = tmp / "bounded.db"
    attached = Attached(
        "--url", server.url, "--capture", str(capture), "--scrape-s", "0.1", "--max-size", f"{BOUND_BYTES}B"
    )
    rng = random.Random(5)
    try:
        attached.wait_for("capture ")
        time.sleep(1.0)  # NOTE: the SUB socket connects asynchronously
        for _ in range(MAX_ROUNDS):
            for _ in range(30):  # NOTE: distinct 40-token prompts: each inserts and evicts pages
                complete(server.url, [rng.randrange(3, 500) for _ in range(40)])
            if dropped_events(capture) > 0:
                break
        wait_idle(server.url)
        code, out, err = attached.stop()
    finally:
        if attached.process.poll() is None:
            attached.process.kill()
    assert code == 0 and "Traceback" not in err, err
    assert "cannot keep its size bound" not in err
    ((first_seq, first_step, max_bytes),) = rows(
        capture, "SELECT first_seq, first_step, max_bytes FROM event_retention"
    )
    assert first_seq > 0 and max_bytes == BOUND_BYTES
    assert capture.stat().st_size <= BOUND_BYTES and used_bytes(capture) <= BOUND_BYTES
    (line,) = [line for line in out.splitlines() if line.startswith("retention ")]
    assert line.split(None, 1)[1].startswith(
        f"keeps at most 256.0 KiB; events from step {first_step} on ({first_seq:,} older events, "
    ), out
    ((kept_min,),) = rows(capture, "SELECT min(first_seq) FROM event_chunks")
    assert kept_min == first_seq  # NOTE: whole chunks, oldest first
    ((usage_rows, last_step),) = rows(capture, "SELECT count(*), max(step) FROM usage")
    assert usage_rows >= (last_step - first_step + 1)  # NOTE: every scrape from the first kept event on
    listed = subprocess.run(
        [sys.executable, "-m", "kvscope", "runs", str(capture), "--json"], capture_output=True, text=True, timeout=120
    )
    (run,) = json.loads(listed.stdout)["runs"]
    assert run["retention"]["dropped_events"] == first_seq and run["retention"]["over_bound"] is None
