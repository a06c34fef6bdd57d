"""The dashboard on a capture under a size bound (docs/captures.md, "Retention"): every page renders,
each page that reads events says in one line which were dropped, and the sidebar warns when what a
run keeps for life is past its bound."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.telemetry import EventKind, LeakCheck, PoolName, PoolTerms, Retention, SQLRecorder, UsageSample
from tests.app.test_retention import BOUND_BYTES, record
from tests.dashboard.conftest import PAGES
from tests.dashboard.test_pages import open_app, page_path

EVENT_PAGES = ("overview", "memory", "tiers", "tree", "evictions", "leaks", "requests")  # NOTE: capacity, fleet: none


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A seeded `kvscope run` with injected leaks under a 1 MiB bound, and its first kept event's step."""
    path = record(tmp_path_factory.mktemp("bounded"), "bounded.db", "--max-size", f"{BOUND_BYTES}B")
    conn = sqlite3.connect(path)
    try:
        ((first_step, first_seq),) = conn.execute("SELECT first_step, first_seq FROM event_retention").fetchall()
    finally:
        conn.close()
    assert first_seq > 0
    return path, int(first_step)


def page(at: AppTest, name: str) -> AppTest:
    if name != "overview":
        at.switch_page(page_path(name)).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders_and_the_event_pages_say_what_was_dropped(
    bounded: tuple[Path, int], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, first_step = bounded
    at = page(open_app(path, monkeypatch), name)
    said = [c.value for c in at.caption if "dropped by retention" in c.value]
    if name in EVENT_PAGES:
        assert said == [
            f"Events before step {first_step:,} ({_dropped(path):,} events) were dropped by retention: what this "
            "page reads from events starts there; leak checks, requests and usage are kept for the whole run."
        ]
    else:
        assert said == []
    assert not [w.value for w in at.sidebar.warning if "size bound" in w.value]


def _dropped(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT first_seq FROM event_retention").fetchone()[0])
    finally:
        conn.close()


def test_the_sidebar_warns_when_the_bound_cannot_be_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 KiB bound: the capture's tables alone are larger; nothing kept for life is dropped, and the
    sidebar says the bound is not kept."""
    path = tmp_path / "tight.db"
    recorder = SQLRecorder(path, retention=Retention(max_bytes=64 * 1024))
    for step in range(20):
        recorder.step = step
        recorder.usage(UsageSample(step, PoolTerms(4096, 1024, 0, 0), None, 0, 0, 1, 0, 100, 64, 1, 1, 0, 0))
        recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step}", slots=np.arange(512))
        recorder.flush()
    recorder.leak_check(LeakCheck(19, "full", 4096, 4096, 0, 0, 0, 0))
    recorder.close()
    at = open_app(path, monkeypatch)
    assert not at.exception
    warnings = [w.value for w in at.sidebar.warning if "size bound" in w.value]
    assert len(warnings) == 1 and warnings[0].startswith("The size bound is not kept: the capture holds"), warnings
