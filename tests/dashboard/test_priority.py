"""The dashboard yields the CPU to the engine it watches: its process runs niced (every thread of it),
by default, with an option to turn it off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from kvscope.dashboard import launch, priority
from tests.dashboard.conftest import ROOT
from tests.dashboard.test_launch import _free_port, _healthy, _wait_until


def _thread_niceness(pid: int | str) -> dict[int, int]:
    """Each thread of a process -> its niceness (field 19 of /proc/PID/task/TID/stat)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except (OSError, IndexError):
            continue
    return found


def test_the_niceness_asked_for_else_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(priority.ENV_NICE, raising=False)
    assert priority.requested_nice([]) == priority.DEFAULT_NICE > 0
    assert priority.requested_nice(["--db", "x.db", "--nice", "0"]) == 0
    monkeypatch.setenv(priority.ENV_NICE, "15")
    assert priority.requested_nice([]) == 15
    assert priority.requested_nice(["--nice", "3"]) == 3  # NOTE: the command line over the environment
    for bad in ("-1", "20", "low"):
        with pytest.raises(ValueError, match="from 0 \\(off\\) to 19"):
            priority.requested_nice(["--nice", bad])
    assert launch.build_parser().parse_args([]).nice == priority.DEFAULT_NICE


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads' niceness read from /proc (Linux)")
def test_every_thread_yields_the_ones_made_before_and_after() -> None:
    script = (
        "import os, threading, time\n"
        "from kvscope.dashboard import priority\n"
        "stop = threading.Event()\n"
        "before = threading.Thread(target=stop.wait); before.start()\n"
        "now = priority.yield_cpu(7)\n"
        "after = threading.Thread(target=stop.wait); after.start()\n"
        "print(now, flush=True); input(); stop.set()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == str(max(7, os.getpriority(os.PRIO_PROCESS, 0)))
        threads = _thread_niceness(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
    finally:
        assert child.wait(timeout=30) == 0
    assert len(threads) == 3, threads
    assert set(threads.values()) == {max(7, os.getpriority(os.PRIO_PROCESS, 0))}, threads


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads' niceness read from /proc (Linux)")
def test_the_dashboard_server_runs_niced(tmp_path: Path) -> None:
    port = _free_port()
    capture = ROOT / "sample_runs" / "shared-prefix.db"
    log = (tmp_path / "streamlit.log").open("w+b")
    server = subprocess.Popen(launch.dashboard_command(capture, port, nice=6), cwd=ROOT, stdout=log, stderr=log)
    try:
        assert _wait_until(lambda: _healthy(port), 90.0), "the dashboard never answered"
        assert set(_thread_niceness(server.pid).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}  # no page ran yet
        with connect(
            f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=[Subprotocol("streamlit")], open_timeout=60
        ) as session:
            rerun = BackMsg()
            rerun.rerun_script.query_string = ""
            session.send(rerun.SerializeToString())
            reply = ForwardMsg()
            while reply.WhichOneof("type") != "script_finished":
                reply.ParseFromString(session.recv(timeout=120))
            threads = _thread_niceness(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert set(threads.values()) == {max(6, os.getpriority(os.PRIO_PROCESS, 0))}, threads
