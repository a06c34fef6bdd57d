"""Many writers into one PostgreSQL database, and what a writer says when the server is not there or goes
away (against a real server: `make test-postgres`; the fault tests stop and start it with pg_ctl)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sqlalchemy.engine import make_url

from kvscope.telemetry.queries import Capture
from tests.postgres_cluster import Cluster, free_port, start, stop

pytestmark = pytest.mark.postgres
psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL driver (pip install 'kvscope[postgres]')")
ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
NUM_WRITERS = 6
EVENTS_EACH = 3_000


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def kvscope(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "kvscope", *args], capture_output=True, text=True, env=env(), timeout=timeout_s, check=False
    )


def test_writer_processes_started_at_once_on_a_new_database_each_record_their_run(postgres_url: str) -> None:
    start_at = time.time() + 3.0  # NOTE: every process imports first, then opens the database at this moment
    writers = [
        subprocess.Popen(
            [PYTHON, "-m", "tests.telemetry.pg_writer_proc", postgres_url, f"w{i}", str(EVENTS_EACH), str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for i in range(NUM_WRITERS)
    ]
    results = [w.communicate(timeout=240) for w in writers]
    for writer, (_out, err) in zip(writers, results, strict=True):
        assert writer.returncode == 0, err
        assert "Traceback" not in err, err
    run_ids = sorted(int(out.split()[-1]) for out, _ in results)
    assert run_ids == list(range(1, NUM_WRITERS + 1))
    capture = Capture(postgres_url)
    try:
        runs = capture.runs()
        assert list(runs.display_status) == ["finished"] * NUM_WRITERS
        assert capture.schema_version > 0
        for run in runs.itertuples():
            events = capture.events(int(run.id), limit=None)
            assert len(events) == EVENTS_EACH, run.id
            assert set(events.rid) == {run.label}
            assert list(events.seq) == list(range(len(events)))  # none lost, none twice
            slots = np.concatenate([np.frombuffer(s, "<i4") for s in events.slots])
            expected = np.column_stack([np.arange(EVENTS_EACH), -np.arange(EVENTS_EACH)]).ravel()
            assert np.array_equal(slots, expected)
    finally:
        capture.close()
    with psycopg.connect(make_url(postgres_url).render_as_string(hide_password=False)) as conn:
        versions = conn.execute("SELECT count(*) FROM kvscope_meta WHERE key = 'schema_version'").fetchone()
        assert versions == (1,)


def one_line_error(done: subprocess.CompletedProcess[str], *expected: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_a_refused_connection_a_wrong_password_and_a_missing_database_are_one_line_each(postgres_url: str) -> None:
    """Every verb that opens a capture; `serve` too (it used to start its scheduler, print 2-3 lines, exit 1)."""
    url = make_url(postgres_url)
    cases = {
        "refused": (url.set(port=free_port()), "Connection refused"),
        "password": (url.set(password="not-the-password"), "password authentication failed"),
        "database": (url.set(database="no_such_database"), 'database "no_such_database" does not exist'),
    }
    for _name, (bad, expected) in cases.items():
        target = bad.render_as_string(hide_password=False)
        for args in (
            ("runs", target),
            ("check", target),
            ("fleet", target),
            ("run", "--workload", "random", "--num-requests", "2", "--capture", target),
            ("serve", "--port", str(free_port()), "--capture", target),  # before any scheduler starts
        ):
            line = one_line_error(kvscope(*args), expected)
            assert line.startswith(f"kvscope {args[0]}: error: ") and "cannot open the database" in line
            assert str(bad.password) not in line  # a URL is printed without its password


def committed_rows(url: str, table: str, run_id: int = 1) -> int:
    with psycopg.connect(make_url(url).render_as_string(hide_password=False), connect_timeout=5) as conn:
        found = conn.execute(f"SELECT count(*) FROM {table} WHERE run_id = %s", (run_id,)).fetchone()
    return int(found[0]) if found else 0


def test_the_server_stopped_mid_run_stops_recording_with_one_line_and_keeps_what_was_committed(
    postgres_url: str,
) -> None:
    cluster = Cluster.from_env(dict(os.environ))
    first = kvscope("run", "--workload", "shared-prefix", "--num-requests", "12", "--capture", postgres_url)
    assert first.returncode == 0, first.stderr
    before = Capture(postgres_url)
    try:
        events_before, report_before = before.events(1, limit=None), before.stored_report(1, "leaks")
    finally:
        before.close()
    run = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "kvscope",
            "run",
            "--workload",
            "multi-turn",
            "--num-requests",
            "400",
            "--rate",
            "40",
            "--capture",
            postgres_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    try:
        deadline = time.monotonic() + 120
        while committed_rows(postgres_url, "event_chunks", run_id=2) < 2:
            assert run.poll() is None and time.monotonic() < deadline, "the run never committed a chunk"
            time.sleep(0.2)
        stop(cluster, "immediate")
        out, err = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
        start(cluster)
    stopped = [line for line in err.splitlines() if "recording stopped" in line]
    assert len(stopped) == 1, err
    assert [line for line in err.splitlines() if line.strip()] == stopped, err  # that one line, nothing else
    assert run.returncode == 4, (out, err)  # the run stops at its next step (runner.EXIT_RECORDING_STOPPED)
    assert "incomplete" in out
    after = Capture(postgres_url)
    try:
        runs = after.runs()
        assert list(runs.id) == [1, 2]
        assert runs.display_status.iloc[0] == "finished"
        assert runs.display_status.iloc[1] not in ("finished", "running")
        pd.testing.assert_frame_equal(after.events(1, limit=None), events_before)
        assert after.stored_report(1, "leaks") == report_before
        assert len(after.events(2, limit=None)) > 0  # what run 2 committed before the stop reads back
    finally:
        after.close()
    verdict = kvscope("check", postgres_url, "--run", "2")
    assert verdict.returncode == 3, verdict.stdout  # inconclusive: never clean
    assert "clean" not in verdict.stdout.split(":", 2)[-1].split()[0]


def complete(port: int) -> dict[str, Any]:
    body = json.dumps({"prompt": "hello there fleet", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return dict(json.loads(reply.read()))


def test_serve_keeps_serving_when_the_server_goes_away_and_marks_its_run_once_it_is_back(postgres_url: str) -> None:
    cluster = Cluster.from_env(dict(os.environ))
    port = free_port()
    serve = subprocess.Popen(
        [PYTHON, "-m", "kvscope", "serve", "--port", str(port), "--capture", postgres_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None and time.monotonic() < deadline, "kvscope serve did not start"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        assert complete(port)["choices"]
        while committed_rows(postgres_url, "requests") == 0:  # NOTE: the first request's rows are committed
            assert time.monotonic() < deadline, "the first request was never written"
            time.sleep(0.5)
        stop(cluster, "immediate")
        try:
            for _ in range(3):
                assert complete(port)["choices"]  # served with the database gone
                time.sleep(1.0)  # NOTE: the recorder hands its rows over at idle points: their write fails
        finally:
            start(cluster)
        assert complete(port)["choices"]
        serve.send_signal(signal.SIGINT)
        out, _ = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 4, out  # NOTE: as run and attach: it served on, its capture is incomplete
    assert "Traceback" not in out
    stopped = [line for line in out.splitlines() if "recording stopped" in line]
    assert len(stopped) == 2 and stopped[-1].endswith("(incomplete: recording stopped)"), out  # said, then summed up
    capture = Capture(postgres_url)
    try:
        runs = capture.runs()
        assert list(runs.display_status) == ["incomplete"]  # marked once the server was back
        assert "capture complete through step" in str(runs.error.iloc[0])
        assert len(capture.requests(1)) >= 1  # the first request, committed before the stop
    finally:
        capture.close()


def test_the_verbs_work_on_a_url_and_never_print_its_password(postgres_url: str) -> None:
    password = str(make_url(postgres_url).password)
    recorded = kvscope("run", "--workload", "shared-prefix", "--num-requests", "8", "--capture", postgres_url)
    assert recorded.returncode == 0, recorded.stderr
    outputs = {"run": recorded}
    for verb in (
        ("runs", postgres_url),
        ("runs", "--json", postgres_url),
        ("check", postgres_url),
        ("check", "--json", postgres_url),
        ("report", "leaks", postgres_url),
        ("diff", postgres_url, postgres_url),
        ("upgrade", postgres_url),
        ("fleet", postgres_url),  # NOTE: exit 1 (no fleet), its one line names the capture
        ("check", "--fleet", postgres_url),  # exit 2 (no fleet), one line
        ("instrument", "--capture", postgres_url, "--", "true"),  # the engine's command: it only starts
    ):
        outputs[" ".join(verb[:2])] = done = kvscope(*verb)
        expected = 1 if verb[0] == "fleet" else 2 if verb[:2] == ("check", "--fleet") else 0
        assert done.returncode == expected, (verb, done.stderr)
    assert "clean" in outputs["check " + postgres_url].stdout
    assert "nothing to upgrade" in outputs["upgrade " + postgres_url].stdout
    for name, done in outputs.items():
        assert password not in done.stdout + done.stderr, name
        assert "Traceback" not in done.stderr, name
