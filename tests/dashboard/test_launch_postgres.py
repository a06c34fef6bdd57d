"""The launcher on a PostgreSQL capture (`python -m kvscope.dashboard.launch --capture URL`): the served
engine records into the database and the dashboard reads it live from there (a real server: `make
test-postgres`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from sqlalchemy.engine import make_url

from kvscope.dashboard import launch
from kvscope.telemetry.queries import Capture
from tests.dashboard.test_launch import _browser_session, _free_port, _healthy, _served_tokens, _wait_until

pytestmark = pytest.mark.postgres


def test_the_launcher_serves_into_a_postgresql_capture_and_the_dashboard_reads_it_live(postgres_url: str) -> None:
    port, serve_port = _free_port(), _free_port()
    command = [sys.executable, "-m", "kvscope.dashboard.launch", "--capture", postgres_url, "--port", str(port)]
    launcher = subprocess.Popen(
        [*command, "--serve-port", str(serve_port), "--num-requests", "400", "--rate", "20"],
        cwd=launch.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(launch.ROOT)},
    )
    try:
        assert _wait_until(lambda: _healthy(port), 90.0), "the dashboard never answered"
        assert _wait_until(lambda: _served_tokens(serve_port) > 0, 60.0), "the load never reached the server"
        with _browser_session(port):  # the dashboard opens the database and reads the live run
            os.killpg(launcher.pid, signal.SIGINT)
            output = launcher.communicate(timeout=60)[0].decode()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, output
    assert "Traceback" not in output, output
    assert str(make_url(postgres_url).password) not in output  # the URL is shown without its password
    assert f"recording {make_url(postgres_url).render_as_string(hide_password=True)}" in output
    capture = Capture(postgres_url)
    try:
        runs = capture.runs()
        assert list(runs.display_status) == ["finished"]
        assert len(capture.requests(1)) > 0
    finally:
        capture.close()
