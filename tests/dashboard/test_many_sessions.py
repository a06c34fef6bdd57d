"""Many browser tabs on a live capture: a real `streamlit run` on a capture a real `kvscope run` is
writing, and SESSIONS websocket sessions (what a tab does) rerunning its pages at once for a bounded
time. No session may meet an exception or an error box, and the dashboard must stay up.

The test runs for SESSIONS_S seconds (KVSCOPE_SESSIONS_S overrides it: the by-hand check runs it for
300 s). Before the reader's pool was one made for many threads, this crashed the dashboard (SQLite's
'Cannot operate on a closed database', then a segfault in libsqlite3)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from kvscope.dashboard import launch
from tests.dashboard.conftest import PAGES
from tests.dashboard.test_launch import _free_port, _healthy, _wait_until

SESSIONS = 10
SESSIONS_S = float(os.environ.get("KVSCOPE_SESSIONS_S", "15"))
RERUN_TIMEOUT_S = 120.0
RUN = [sys.executable, "-m", "kvscope", "run", "--no-report"]
ERROR_ALERT = 1  # Alert.Format.ERROR: st.error


def _problems_in(reply: ForwardMsg) -> list[str]:
    """An exception or an error box the script put on the page."""
    if reply.WhichOneof("type") != "delta" or reply.delta.WhichOneof("type") != "new_element":
        return []
    element = reply.delta.new_element
    kind = element.WhichOneof("type")
    if kind == "exception":
        return [f"{element.exception.type}: {element.exception.message}"]
    if kind == "alert" and element.alert.format == ERROR_ALERT:
        return [f"error box: {element.alert.body}"]
    return []


def _tab(port: int, index: int, until: float, problems: list[str], reruns: list[int]) -> None:
    """One tab: reruns the pages in turn (starting at its own) until `until`."""
    try:
        with connect(
            f"ws://127.0.0.1:{port}/_stcore/stream",
            subprotocols=[Subprotocol("streamlit")],
            open_timeout=60,
            max_size=None,
        ) as session:
            page = index
            while time.monotonic() < until:
                rerun = BackMsg()
                rerun.rerun_script.query_string = ""
                rerun.rerun_script.page_name = PAGES[page % len(PAGES)]
                session.send(rerun.SerializeToString())
                reply = ForwardMsg()
                while reply.WhichOneof("type") != "script_finished":
                    reply.ParseFromString(session.recv(timeout=RERUN_TIMEOUT_S))
                    problems += [f"tab {index} on {PAGES[page % len(PAGES)]}: {p}" for p in _problems_in(reply)]
                reruns[index] += 1
                page += 1
    except Exception as err:  # a dropped connection or a rerun that never finished
        problems.append(f"tab {index}: {type(err).__name__}: {err}")


@contextmanager
def _live_capture(db: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real engine writing `db`, paced so that it is still running when the tabs are done."""
    writer = subprocess.Popen(
        [*RUN, "--workload", "multi-tenant", "--num-requests", "100000", "--rate", "8", "--capture", str(db)],
        cwd=launch.ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield writer
    finally:
        writer.terminate()
        writer.wait(timeout=60)


def _written_bytes(db: Path) -> int:
    """The capture's bytes so far, its log's included (a WAL-mode file grows at checkpoints only)."""
    return sum(path.stat().st_size for path in (db, Path(f"{db}-wal")) if path.exists())


@pytest.mark.slow
def test_ten_tabs_on_a_live_capture_run_without_an_error(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    port = _free_port()
    with _live_capture(db) as writer:
        assert _wait_until(lambda: _written_bytes(db) > 100_000, 240.0), "the engine never wrote"
        log = (tmp_path / "streamlit.log").open("w+b")
        dashboard = subprocess.Popen(launch.dashboard_command(db, port), cwd=launch.ROOT, stdout=log, stderr=log)
        try:
            assert _wait_until(lambda: _healthy(port), 90.0), "the dashboard never answered"
            problems: list[str] = []
            reruns = [0] * SESSIONS
            until = time.monotonic() + SESSIONS_S
            tabs = [threading.Thread(target=_tab, args=(port, i, until, problems, reruns)) for i in range(SESSIONS)]
            for tab in tabs:
                tab.start()
            for tab in tabs:
                tab.join(SESSIONS_S + RERUN_TIMEOUT_S + 60)
            assert writer.poll() is None, "the engine stopped writing before the tabs were done"
            assert dashboard.poll() is None, f"the dashboard died with {dashboard.returncode}"
        finally:
            dashboard.terminate()
            dashboard.wait(timeout=30)
        log.seek(0)
        output = log.read().decode(errors="replace")
    print(f"{SESSIONS} tabs, {SESSIONS_S:g} s: {sum(reruns)} reruns ({reruns})")
    assert not problems, "\n".join(problems[:20])
    assert all(reruns), reruns
    assert "Traceback" not in output and "closed database" not in output, output[-4000:]
