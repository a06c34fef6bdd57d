"""`make run`'s launcher: the engine writes a fresh capture under runs/ and the dashboard opens exactly it."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from kvscope.dashboard import launch


def test_the_dashboard_opens_the_capture_the_engine_writes(tmp_path: Path) -> None:
    capture = launch.live_capture_path(tmp_path / "runs", now=0.0)
    assert capture.parent == tmp_path / "runs" and capture.name.endswith("-live.db")
    server = launch.serve_command(capture, 30123)
    assert server[1:4] == ["-m", "kvscope", "serve"] and server[server.index("--port") + 1] == "30123"
    assert server[server.index("--capture") + 1] == str(capture) and server[server.index("--host") + 1] == "127.0.0.1"
    load = launch.load_command(30123, "multi-tenant", 200, 4.0)
    assert load[1:4] == ["-m", "kvscope", "load"] and load[load.index("--url") + 1] == "http://127.0.0.1:30123"
    assert load[load.index("--workload") + 1] == "multi-tenant" and load[load.index("--rate") + 1] == "4.0"
    dashboard = launch.dashboard_command(capture, port=8999)
    assert dashboard[-3:] == ["--", "--db", str(capture)] and "8999" in dashboard
    assert dashboard[dashboard.index("run") + 1] == str(launch.ROOT / "app.py")


def test_the_dashboard_listens_on_loopback_without_usage_statistics_or_deploy_button(tmp_path: Path) -> None:
    command = launch.dashboard_command(tmp_path / "x.db")
    settings = dict(zip(command[::2], command[1::2], strict=False)) | dict(
        zip(command[1::2], command[2::2], strict=False)
    )
    assert settings["--server.address"] == "127.0.0.1"
    assert settings["--browser.gatherUsageStats"] == "false" and settings["--client.toolbarMode"] == "minimal"
    assert settings["--server.headless"] == "true" and settings["--server.fileWatcherType"] == "none"
    config = tomllib.loads((launch.ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1" and config["browser"]["gatherUsageStats"] is False
    assert config["client"]["toolbarMode"] == "minimal" and config["server"]["fileWatcherType"] == "none"


def test_the_makefiles_example_arguments_are_ones_the_launcher_takes() -> None:
    """`make run ARGS="..."` as the Makefile's comment shows it: the launcher parses every example."""
    examples = re.findall(r'ARGS="([^"]*)"', (launch.ROOT / "Makefile").read_text())
    assert examples
    for example in examples:
        launch.build_parser().parse_args(shlex.split(example))


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


def _served_tokens(port: int) -> float:
    """Prompt tokens the server has counted (its /metrics), 0 while it is not answering."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as reply:
            text = reply.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:prompt_tokens_total"))


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_serves_on_loopback_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    port, serve_port = _free_port(), _free_port()
    runs_dir = tmp_path / "runs"
    venv = Path(sys.executable).parents[1]
    make = subprocess.Popen(  # -o: this venv is the one under test, even when pyproject.toml is newer
        [
            "make",
            "--no-print-directory",
            "-o",
            f"{venv}/.kvscope-installed",
            "run",
            f"PORT={port}",
            f"ARGS=--runs-dir {runs_dir} --num-requests 400 --rate 20 --serve-port {serve_port}",
        ],
        cwd=launch.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "VENV": str(venv)},
    )
    try:
        assert _wait_until(lambda: _healthy(port), 90.0), "the dashboard never answered"
        assert _listening_addresses(port) == {"127.0.0.1"} and _listening_addresses(serve_port) == {"127.0.0.1"}
        assert _wait_until(lambda: _served_tokens(serve_port) > 0, 60.0), "the load never reached the server"
        with _browser_session(port):  # the dashboard opens the capture and reads it, as for a browser tab
            (streamlit,) = [pid for pid in _session_processes(make.pid) if b"streamlit" in _cmdline(pid)]
            assert _inotify_watches(streamlit) == 0  # its file watcher would watch the whole tree, .venv included
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
        principals = {p for (p,) in conn.execute("SELECT DISTINCT principal FROM requests")}
    conn.close()
    assert status == "finished"  # the server drains what is in flight and closes its capture
    assert len(principals - {None}) > 1  # the multi-tenant workload's users, as the served requests' principals
    assert sorted(p.name for p in runs_dir.iterdir()) == [capture.name]  # one file: no -wal or -shm beside it
    alone = tmp_path / "copy" / capture.name
    alone.parent.mkdir()
    shutil.copyfile(capture, alone)
    copied, original = (
        subprocess.run(
            [sys.executable, "-m", "kvscope", "check", str(path)], capture_output=True, text=True, check=False
        )
        for path in (alone, capture)
    )
    assert copied.returncode == original.returncode == 0, copied.stdout + copied.stderr
    assert copied.stdout.replace(str(alone), str(capture)) == original.stdout  # every check of the run


@contextlib.contextmanager
def _browser_session(port: int) -> Iterator[None]:
    """What a browser tab does: a session on the dashboard's websocket that runs the app once (to
    its script_finished message) and stays open."""
    rerun = BackMsg()
    rerun.rerun_script.query_string = ""
    with connect(
        f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=[Subprotocol("streamlit")], open_timeout=30
    ) as session:
        session.send(rerun.SerializeToString())
        reply = ForwardMsg()
        while reply.WhichOneof("type") != "script_finished":
            reply.ParseFromString(session.recv(timeout=60))
        yield


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _inotify_watches(pid: int) -> int:
    """Inotify watches the process holds (the `inotify wd:` lines of its descriptors' fdinfo)."""
    found = 0
    for fdinfo in Path(f"/proc/{pid}/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            found += sum(line.startswith("inotify wd:") for line in fdinfo.read_text().splitlines())
    return found


PROGRESS = launch.ROOT / "scripts" / "show_progress.py"
# a pip-like install: what it fetches, a long silence, what it installed
FAKE_PIP = """
import sys, time
print("Requirement already satisfied: numpy", flush=True)
print("Collecting streamlit>=1.37", flush=True)
print("  Downloading streamlit-1.67.0-py3-none-any.whl (10.1 MB)", flush=True)
print("Installing collected packages: " + ", ".join(f"package-number-{i}" for i in range(40)), flush=True)
time.sleep(2.6)
print("Successfully installed streamlit-1.67.0", flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_the_install_printer_shows_what_pip_does_and_ticks_while_it_is_silent(code: int) -> None:
    done = subprocess.run(
        [sys.executable, str(PROGRESS), "--tick-s", "1", "--", sys.executable, "-c", FAKE_PIP, str(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == code, done
    assert lines[0] == "    Collecting streamlit>=1.37" and lines[-1] == "    Successfully installed streamlit-1.67.0"
    assert lines[1].strip().startswith("Downloading streamlit") and lines[2].startswith("    Installing collected")
    assert len(lines[2]) <= 120  # one package list, cut to a line
    ticks = [line for line in lines if "still working" in line]
    assert len(ticks) >= 2 and ticks[0] == "    … still working, 1 s so far", lines
    assert not any("Requirement already satisfied" in line for line in lines)


def _make_recipes() -> str:
    """The Makefile as make itself expands it (`make -pn` prints its database)."""
    return subprocess.run(
        ["make", "-pn", "--no-print-directory", "lint"], cwd=launch.ROOT, capture_output=True, text=True, check=False
    ).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_install_step_runs_under_the_progress_printer() -> None:
    database = _make_recipes()
    (show,) = [line.split(" := ", 1)[1] for line in database.splitlines() if line.startswith("SHOW := ")]
    assert show.endswith("scripts/show_progress.py --")
    installs = [line for line in (launch.ROOT / "Makefile").read_text().splitlines() if "PIP) " in line]
    # NOTE: two installs per venv: kvscope's own, vLLM's and SGLang's (make test-engines builds the last two), and
    # bench_serving's client into an SGLang venv made before it was one of its packages (after `||`)
    assert len(installs) == 7, installs
    assert all(line.strip().startswith("@$(SHOW) $(") or "|| $(SHOW) $(" in line for line in installs), installs


def test_the_launcher_says_which_child_ended_and_how(capsys: pytest.CaptureFixture[str]) -> None:
    """A child of `make run` that dies (the dashboard killed by a segfault) is named with its signal."""
    crashing = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert launch._wait_any({"the dashboard": crashing, "kvscope serve": waiting}) == 1
    finally:
        waiting.kill()
        waiting.wait()
    assert capsys.readouterr().err == (
        "kvscope: error: the dashboard was killed by SIGSEGV (signal 11); stopping the rest\n"
    )
    exiting = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert launch._wait_any({"kvscope serve": exiting}) == 3
    assert capsys.readouterr().err == "kvscope: error: kvscope serve exited with code 3; stopping the rest\n"
