"""`kvscope serve` killed with SIGKILL: the HTTP front dies without telling the scheduler. The
scheduler and its writer end within seconds and the run is 'crashed' ("the HTTP front died"),
so `kvscope check` is inconclusive (exit 3), as for `kvscope run` killed the same way."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvscope.telemetry.writer import HEARTBEAT_INTERVAL_S
from tests.server.serving import serving

MODEL = "kvscope-tiny"
GONE_WITHIN_S = 15.0  # NOTE: a bound on a hang, not a timing claim: they exit in about a second


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def stream_until_first_token(url: str, started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    started.set()
    except httpx.HTTPError:
        pass  # the server was killed under it


@pytest.mark.parametrize("when", ["idle", "mid-load"])
def test_a_killed_serve_is_crashed_not_finished_and_check_is_inconclusive(tmp_path: Path, when: str) -> None:
    capture = tmp_path / "serve.db"
    with serving(capture) as server:
        assert (
            httpx.post(
                f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60
            ).status_code
            == 200
        )
        with sqlite3.connect(capture) as db:
            (scheduler_pid,) = db.execute("select pid from runs").fetchone()
        writers = children(scheduler_pid)
        assert writers, "the scheduler's writer process"
        if when == "idle":  # an idle server's capture beats: it reads as running, however long it idles
            with sqlite3.connect(capture) as db:
                (before,) = db.execute("select heartbeat_at from runs").fetchone()
            time.sleep(HEARTBEAT_INTERVAL_S + 1.5)
            with sqlite3.connect(capture) as db:
                (after,) = db.execute("select heartbeat_at from runs").fetchone()
            assert after > before, "no heartbeat while idle"
        if when == "mid-load":
            started = threading.Event()
            threading.Thread(target=stream_until_first_token, args=(server.url, started), daemon=True).start()
            assert started.wait(60)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(pid) for pid in (scheduler_pid, *writers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in (scheduler_pid, *writers)), "the scheduler and writer linger"
    with sqlite3.connect(capture) as db:
        status, error = db.execute("select status, error from runs").fetchone()
        in_flight = db.execute("select count(*) from requests where status = 'in_flight'").fetchone()[0]
    assert status == "crashed" and "the HTTP front died" in error
    assert in_flight == (1 if when == "mid-load" else 0)
    check = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(capture), "--json"], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 3, check.stdout + check.stderr
    assert json.loads(check.stdout)["verdict"] == "inconclusive"


def test_a_dead_scheduler_is_a_503_server_error_to_the_requests_in_flight(tmp_path: Path) -> None:
    capture = tmp_path / "serve.db"
    with serving(capture) as server:
        with sqlite3.connect(capture) as db:
            (scheduler_pid,) = db.execute("select pid from runs").fetchone()
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "prompt": "keep going", "max_tokens": 1500, "stream": True, "ignore_eos": True}
            with (
                httpx.Client(timeout=60) as http,
                http.stream("POST", f"{server.url}/v1/completions", json=body) as reply,
            ):
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        started.set()

        streaming = threading.Thread(target=stream, daemon=True)
        streaming.start()
        assert started.wait(60)
        plain: list[httpx.Response] = []
        posting = threading.Thread(
            target=lambda: plain.append(
                httpx.post(
                    f"{server.url}/v1/completions",
                    json={"model": MODEL, "prompt": "wait", "max_tokens": 1500, "ignore_eos": True},
                    timeout=60,
                )
            ),
            daemon=True,
        )
        posting.start()
        time.sleep(0.5)  # NOTE: the plain request is in flight (its stream neighbour runs for seconds)
        os.kill(scheduler_pid, signal.SIGKILL)
        posting.join(60)
        streaming.join(60)
        code, printed = server.stop()
    assert plain and plain[0].status_code == 503, plain[0].text if plain else "no reply"
    assert plain[0].json()["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]" and json.loads(events[-2]).get("error", {}).get("type") == "server_error", events[-4:]
    assert code == 1 and "Traceback" not in printed, printed
