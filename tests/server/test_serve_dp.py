"""`kvscope serve --dp-size 2`: two scheduler processes behind one front, each its own run in the
one capture; the router's choice and what it saw land in every request's row; prefix_affinity
loses fewer cached tokens to routing than round_robin; /metrics labels each rank; rank r's KV
events on port + r; a killed rank fails its own requests and the other serves on; a frozen rank is
skipped and does not hold up the stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from kvscope.app.serve import DRAIN_S, RANK_SILENT_S
from kvscope.server.kv_events import decode_batch
from tests.server.serving import Server, serving, start_server

REPO = Path(__file__).resolve().parents[2]
MODEL = "kvscope-tiny"
NUM_REQUESTS = 24
GONE_WITHIN_S = 30.0  # NOTE: a bound on a hang, not a timing claim


def run_load(url: str, num_requests: int = NUM_REQUESTS) -> dict[str, Any]:
    """`kvscope load` of the multi-tenant workload (tenants' prompts behind a common one); its summary."""
    args = ["--workload", "multi-tenant", "--num-requests", str(num_requests), "--concurrency", "2"]
    cli = subprocess.run(
        [sys.executable, "-m", "kvscope", "load", "--url", url, *args, "--max-tokens", "2", "--json", "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    summary: dict[str, Any] = json.loads(cli.stdout)
    return summary


def routing_loss(capture: Path) -> float:
    """The fleet's routing loss as `kvscope fleet --json` reads it: Σ max(0, elsewhere − routed) / Σ
    prompt tokens over the capture's routed requests (one dispatch method per capture here)."""
    cli = subprocess.run(
        [sys.executable, "-m", "kvscope", "fleet", str(capture), "--json"], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 0, cli.stderr
    (routing,) = json.loads(cli.stdout)["routing"]
    return float(routing["loss_share"])


LOADED: dict[str, tuple[Path, dict[str, Any], str, str]] = {}


def loaded(method: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str, str]:
    """A --dp-size 2 server under the load, once per method: (capture, load summary, /metrics
    text, /server_info) as they were before the server stopped (exit 0)."""
    if method not in LOADED:
        capture = tmp_path_factory.mktemp(method) / "dp.db"
        with serving(capture, "--dp-size", "2", "--load-balance-method", method) as server:
            summary = run_load(server.url)
            metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
            info = httpx.get(f"{server.url}/server_info", timeout=30).text
            code, printed = server.stop()
            assert code == 0, printed
        LOADED[method] = (capture, summary, metrics, info)
    return LOADED[method]


def fleet_runs(capture: Path) -> list[tuple[int, str, str, dict[str, Any]]]:
    """(run id, label, status, config's fleet) of every run."""
    with contextlib.closing(sqlite3.connect(capture)) as db:
        rows = db.execute("SELECT id, label, status, config FROM runs ORDER BY id").fetchall()
    return [(rid, label, status, json.loads(config)["fleet"]) for rid, label, status, config in rows]


def test_two_ranks_answer_every_request_each_into_its_own_clean_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    capture, summary, _, info = loaded("round_robin", tmp_path_factory)
    assert summary["requests"] == {
        "planned": NUM_REQUESTS,
        "sent": NUM_REQUESTS,
        "completed": NUM_REQUESTS,
        "failed": 0,
    }
    runs = fleet_runs(capture)
    assert sorted(label for _, label, _, _ in runs) == ["serve dp 0", "serve dp 1"]
    fleets = [fleet for *_, fleet in runs]
    assert len({fleet["id"] for fleet in fleets}) == 1
    assert sorted(fleet["rank"] for fleet in fleets) == [0, 1]
    assert {(fleet["size"], fleet["dispatch"]) for fleet in fleets} == {(2, "round_robin")}
    with contextlib.closing(sqlite3.connect(capture)) as db:
        per_run = dict(db.execute("SELECT run_id, COUNT(*) FROM requests GROUP BY run_id").fetchall())
        unrouted = db.execute("SELECT COUNT(*) FROM requests WHERE dispatch IS NULL").fetchone()[0]
        dispatches = {d for (d,) in db.execute("SELECT DISTINCT dispatch FROM requests")}
    assert sum(per_run.values()) == NUM_REQUESTS and len(per_run) == 2 and min(per_run.values()) > 0
    assert unrouted == 0 and dispatches == {"round_robin"}
    for run_id, _, status, _ in runs:
        assert status == "finished"
        check = subprocess.run(
            [sys.executable, "-m", "kvscope", "check", str(capture), "--run", str(run_id)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert check.returncode == 0, check.stdout + check.stderr
    shown = json.loads(info)
    assert (shown["dp_size"], shown["load_balance_method"]) == (2, "round_robin")
    assert [(r["dp_rank"], r["live"]) for r in shown["dp_ranks"]] == [(0, True), (1, True)]


def test_prefix_affinity_loses_fewer_cached_tokens_to_routing_than_round_robin(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    robin, _, _, _ = loaded("round_robin", tmp_path_factory)
    affinity, summary, _, _ = loaded("prefix_affinity", tmp_path_factory)
    assert summary["requests"]["failed"] == 0
    robin_loss, affinity_loss = routing_loss(robin), routing_loss(affinity)
    assert robin_loss > 0.05, robin_loss  # alternating ranks: a tenant's prefix is often on the other one
    assert affinity_loss < robin_loss, (affinity_loss, robin_loss)


def test_metrics_label_every_series_with_its_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    _, _, metrics, _ = loaded("round_robin", tmp_path_factory)
    for rank in ("0", "1"):
        assert f'kvscope_scheduler_up{{dp_rank="{rank}"}} 1.0' in metrics
        for name in ("sglang:num_running_reqs", "sglang:kv_used_tokens"):
            assert f'{name}{{dp_rank="{rank}",engine_type="unified",model_name="{MODEL}"}}' in metrics, name
        assert f'sglang:queue_time_seconds_count{{dp_rank="{rank}"' in metrics
    # NOTE: as SGLang's tokenizer exports them: one series for the server, whatever rank served
    tokenizer = ("sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:generation_tokens_total")
    tokenizer += ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds")
    tokenizer += ("sglang:e2e_request_latency_seconds",)
    unlabelled = [
        line
        for line in metrics.splitlines()
        if line
        and not line.startswith("#")
        and "dp_rank=" not in line
        and not line.startswith(("kvscope_requests", *tokenizer))
    ]
    assert unlabelled == []
    for name in tokenizer:
        assert not [line for line in metrics.splitlines() if line.startswith(name) and "dp_rank" in line], name
    assert 'sglang:evicted_tokens_total{cache_type="RadixCache",dp_rank="0",pp_rank="0",tp_rank="0"}' in metrics


def free_port_pair() -> int:
    """A port P with P + 1 also free (bound and released; a race with the rest of the machine is unlikely)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise AssertionError("no two adjacent free ports")


def test_rank_r_publishes_kv_events_on_the_port_plus_r(tmp_path: Path) -> None:
    port = free_port_pair()
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True})
    context = zmq.Context()
    subs = []
    try:
        with serving(None, "--level", "off", "--dp-size", "2", "--kv-events-config", config) as server:
            for offset in (0, 1):
                sub = context.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.setsockopt(zmq.RCVTIMEO, 200)
                sub.connect(f"tcp://127.0.0.1:{port + offset}")
                subs.append(sub)
            time.sleep(0.5)  # NOTE: ZMQ's slow joiner: a SUB misses what was sent before it connected
            for i in range(4):  # round robin: two on each rank
                body = {"model": MODEL, "prompt": f"rank test {i} " * 8, "max_tokens": 2}
                assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
            ranks: list[set[int | None]] = [set(), set()]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(ranks):
                for offset, sub in enumerate(subs):
                    with contextlib.suppress(zmq.Again):
                        _, _, payload = sub.recv_multipart()
                        ranks[offset].add(decode_batch(payload).attn_dp_rank)
            assert ranks == [{0}, {1}]
            assert server.stop()[0] == 0
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--dp-size", "0"], "--dp-size must be at least 1, got 0"),
        (["--dp-size", "-3"], "--dp-size must be at least 1, got -3"),
        (["--dp-size", "100000000"], "--dp-size 100000000: the ranks' pools need"),
        (
            ["--dp-size", "2", "--kv-events-config", '{"publisher": "zmq", "endpoint": "ipc:///tmp/kvscope-dp-x"}'],
            "cannot be shared by --dp-size 2 ranks",
        ),
    ],
)
def test_a_bad_fleet_is_one_line_and_exit_2(extra: list[str], says: str) -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "kvscope", "serve", "--port", "0", "--device", "cpu", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvscope serve: error: ") and says in lines[0], cli.stderr


def rank_pids(server: Server) -> list[int]:
    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    return [rank["pid"] for rank in info["dp_ranks"]]


def stream_events(url: str, started: threading.Event, events: list[dict[str, Any]]) -> None:
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
                started.set()


def test_a_killed_rank_fails_its_requests_and_the_other_serves_on(tmp_path: Path) -> None:
    with serving(None, "--level", "off", "--dp-size", "2") as server:
        ok = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=ok, timeout=60).status_code == 200  # rank 0
        started, events = threading.Event(), []  # round robin: the stream goes to rank 1
        streamer = threading.Thread(target=stream_events, args=(server.url, started, events), daemon=True)
        streamer.start()
        assert started.wait(60), "the stream never started"
        pids = rank_pids(server)
        os.kill(pids[1], signal.SIGKILL)
        streamer.join(GONE_WITHIN_S)
        assert not streamer.is_alive()
        assert events[-1]["error"]["code"] == "scheduler_unavailable", events[-1]
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 200
        assert health.json() == {"status": "degraded", "live_dp_ranks": [0], "dead_dp_ranks": [1]}
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert 'kvscope_scheduler_up{dp_rank="1"} 0.0' in metrics
        for _ in range(3):  # every new request goes to rank 0
            assert httpx.post(f"{server.url}/v1/completions", json=ok, timeout=60).status_code == 200
        os.kill(pids[0], signal.SIGKILL)
        code = server.process.wait(GONE_WITHIN_S)
        _, printed = server.stop()
        assert code == 1
        assert "the scheduler process of dp rank 1 exited; serving on 1 of 2 ranks" in printed
        assert "the scheduler process of dp rank 0 exited\n" in printed


def test_a_frozen_rank_is_skipped_reported_and_does_not_hold_up_the_stop(tmp_path: Path) -> None:
    """A rank stopped with SIGSTOP (a hung process): after the silence bound dispatch skips it, /health
    reads degraded, its stream ends 503 at the stop, and SIGTERM ends the server within its drain bound."""
    server = start_server(None, "--level", "off", "--dp-size", "2")
    pids: list[int] = []
    try:
        ok = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=ok, timeout=60).status_code == 200  # rank 0
        started, events = threading.Event(), []  # round robin: the stream goes to rank 1
        streamer = threading.Thread(target=stream_events, args=(server.url, started, events), daemon=True)
        streamer.start()
        assert started.wait(60), "the stream never started"
        pids = rank_pids(server)
        os.kill(pids[1], signal.SIGSTOP)
        deadline = time.monotonic() + RANK_SILENT_S + GONE_WITHIN_S
        health: dict[str, Any] = {}
        while time.monotonic() < deadline and health.get("status") != "degraded":
            time.sleep(0.5)
            health = httpx.get(f"{server.url}/health", timeout=30).json()
        assert health == {"status": "degraded", "live_dp_ranks": [0], "dead_dp_ranks": [], "unresponsive_dp_ranks": [1]}
        for _ in range(4):  # round robin would send every other one to the frozen rank
            assert httpx.post(f"{server.url}/v1/completions", json=ok, timeout=30).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(DRAIN_S)  # NOTE: a bound on a hang: it never ended before
        streamer.join(GONE_WITHIN_S)
        assert not streamer.is_alive() and events[-1]["error"]["code"] == "scheduler_unavailable", events[-1]
        assert not Path(f"/proc/{pids[1]}").exists() or "zombie" in Path(f"/proc/{pids[1]}/status").read_text()
        _, printed = server.stop()
        assert code == 1
        assert "the scheduler process of dp rank 1 has not answered for 10 s; serving on 1 of 2 ranks" in printed
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.kill()


@pytest.mark.parametrize("in_flight", [True, False], ids=["a-stream-in-flight", "idle"])
def test_a_stopped_single_scheduler_does_not_hold_up_the_stop(tmp_path: Path, in_flight: bool) -> None:
    """Issue 40, point 20: one scheduler (no --dp-size) stopped with SIGSTOP just before SIGTERM, too soon
    for the silence bound: the server ends within its drain bound (it waited JOIN_TIMEOUT_S, 66 s, and
    printed nothing), says in one line why it killed the scheduler, and exits 1."""
    server = start_server(tmp_path / "c.db", "--level", "summary")
    pids: list[int] = []
    try:
        ok = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=ok, timeout=60).status_code == 200
        started, events = threading.Event(), []
        if in_flight:
            streamer = threading.Thread(target=stream_events, args=(server.url, started, events), daemon=True)
            streamer.start()
            assert started.wait(60), "the stream never started"
        pids = rank_pids(server)
        os.kill(pids[0], signal.SIGSTOP)
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(DRAIN_S)  # NOTE: a bound on a hang
        _, printed = server.stop()
        assert code == 1, printed
        killed = "kvscope serve: error: the scheduler process is stopped (SIGSTOP): killed it; its run stays running"
        assert printed.count(killed) == 1 and "Traceback" not in printed, printed
        if in_flight:
            streamer.join(GONE_WITHIN_S)
            assert events[-1]["error"]["code"] == "scheduler_unavailable", events[-1]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.kill()


CTRL_C_TRIES = 3


def test_ctrl_c_under_load_ends_within_the_drain_bound_without_a_traceback(tmp_path: Path) -> None:
    """Issue 40, point 21: Ctrl-C (SIGINT to the whole process group: the front and both schedulers) while a
    load keeps every slot busy, several times: each stop ends within the drain bound, exit 0, with no
    traceback from any process (stdout and stderr are one stream here) and its one 'stopped' line."""
    for attempt in range(CTRL_C_TRIES):
        server = start_server(tmp_path / f"c{attempt}.db", "--level", "full", "--dp-size", "2", preexec_fn=os.setsid)
        load_args = ["--workload", "multi-tenant", "--num-requests", "400", "--concurrency", "8", "--max-tokens", "64"]
        load = subprocess.Popen(
            [sys.executable, "-m", "kvscope", "load", "--url", server.url, *load_args, "--quiet"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=REPO,
        )
        try:
            deadline = time.monotonic() + GONE_WITHIN_S
            while time.monotonic() < deadline and not busy(server.url):
                time.sleep(0.2)
            assert busy(server.url), "the load never ran"
            os.killpg(server.process.pid, signal.SIGINT)
            code = server.process.wait(DRAIN_S)  # NOTE: a bound on a hang
            _, printed = server.stop()
            assert code == 0 and "Traceback" not in printed, (attempt, printed)
            assert printed.count("kvscope serve: stopped (SIGINT)") == 1, (attempt, printed)
        finally:
            load.kill()
            load.wait(10)
            server.kill()


def busy(url: str) -> bool:
    """Whether requests are running on the server (its /metrics' running gauge above 0)."""
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("sglang:num_running_reqs") and float(line.rsplit(" ", 1)[1]) > 0:
                return True
    return False
