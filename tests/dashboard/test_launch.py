"""`make run`'s launcher: the engine writes a fresh capture under runs/ and the dashboard opens exactly it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvscope.dashboard import launch


def test_the_dashboard_opens_the_capture_the_engine_writes(tmp_path: Path) -> None:
    capture = launch.live_capture_path(tmp_path / "runs", now=0.0)
    assert capture.parent == tmp_path / "runs" and capture.name.endswith("-live.db")
    engine = launch.engine_command(capture, "multi-turn", 200, 4.0)
    assert engine[1:4] == ["-m", "kvscope", "run"]
    assert engine[engine.index("--capture") + 1] == str(capture) and engine[engine.index("--pace") + 1] == "4.0"
    dashboard = launch.dashboard_command(capture, port=8999)
    assert dashboard[-3:] == ["--", "--db", str(capture)] and "8999" in dashboard
    assert dashboard[dashboard.index("run") + 1] == str(launch.ROOT / "app.py")


def test_the_dashboard_listens_on_loopback_without_usage_statistics_or_deploy_button(tmp_path: Path) -> None:
    command = launch.dashboard_command(tmp_path / "x.db")
    settings = dict(zip(command[::2], command[1::2], strict=False)) | dict(zip(command[1::2], command[2::2],
                                                                               strict=False))
    assert settings["--server.address"] == "127.0.0.1"
    assert settings["--browser.gatherUsageStats"] == "false" and settings["--client.toolbarMode"] == "minimal"
    assert settings["--server.headless"] == "true"
    config = tomllib.loads((launch.ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1" and config["browser"]["gatherUsageStats"] is False
    assert config["client"]["toolbarMode"] == "minimal"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port`, from /proc/net/tcp (state 0A)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def _session_processes(sid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session id
            pids.append(int(stat.parent.name))
    return pids


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_serves_on_loopback_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    port = _free_port()
    runs_dir = tmp_path / "runs"
    venv = Path(sys.executable).parents[1]
    make = subprocess.Popen(  # -o: this venv is the one under test, even when pyproject.toml is newer
        ["make", "--no-print-directory", "-o", f"{venv}/.kvscope-installed", "run", f"PORT={port}",
         f"ARGS=--runs-dir {runs_dir} --num-requests 400 --pace 20"],
        cwd=launch.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "VENV": str(venv)},
    )
    try:
        assert _wait_until(lambda: _healthy(port), 90.0), "the dashboard never answered"
        assert _listening_addresses(port) == {"127.0.0.1"}
        os.killpg(make.pid, signal.SIGINT)  # what Ctrl-C at the terminal does: the whole group
        output = make.communicate(timeout=60)[0].decode()
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
    assert make.returncode in (0, -signal.SIGINT), output  # make itself may end by the Ctrl-C, silently
    assert "make: ***" not in output and "Traceback" not in output, output
    assert "kvscope: starting the dashboard on http://127.0.0.1:" in output
    assert _wait_until(lambda: not _session_processes(make.pid), 10.0), _session_processes(make.pid)
    (capture,) = runs_dir.glob("*-live.db")
    with sqlite3.connect(f"file:{capture}?mode=ro", uri=True) as conn:
        (status,) = conn.execute("SELECT status FROM runs").fetchone()
    assert status != "running"  # closed: interrupted (or finished, had it ended first)
