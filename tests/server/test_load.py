"""`kvscope load`: the request plan (sessions), percentiles, the JSON shape, API-key mapping, the
one-line exit 2 when no server answers; against a real `kvscope serve` subprocess: every request
succeeds, next turns wait for their previous turn, the capture holds every request under its
workload user (or key + user), and SIGTERM prints what was gathered."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvscope.server.load import (
    ApiKey,
    LoadConfig,
    LoadReport,
    RequestResult,
    _Driver,
    arrival_offsets,
    format_summary,
    percentile,
    plan_requests,
    read_api_keys,
    run_load,
    summarize,
)
from kvscope.workloads import generate
from tests.server.serving import Server, serving

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_multi_turn_plan_sends_each_turn_after_the_previous_turn_of_its_conversation() -> None:
    trace = generate("multi-turn", num_requests=40, seed=3)
    plan = plan_requests(trace)
    assert [p.rid for p in plan] == [t.rid for t in trace]
    for planned, request in zip(plan, trace, strict=True):
        assert planned.prompt_ids == request.prompt_ids.tolist()
        assert planned.max_tokens == request.output_len and planned.user == request.user
        conversation, turn = planned.rid.rsplit("-t", 1)
        if turn == "0":
            assert planned.after is None
        else:
            assert planned.after is not None and plan[planned.after].rid == f"{conversation}-t{int(turn) - 1}"


def test_branches_follow_their_parent_and_independent_requests_follow_nothing() -> None:
    plan = plan_requests(generate("branching", num_requests=20, seed=1))
    for planned in plan:
        parent = planned.rid.rsplit(".", 1)[0]
        assert (planned.after is None) == (parent == planned.rid)
        if planned.after is not None:
            assert plan[planned.after].rid == parent
    assert all(p.after is None for p in plan_requests(generate("shared-prefix", num_requests=20, seed=1)))


def test_plan_indices_rid_prefix_and_max_tokens_override() -> None:
    plan = plan_requests(
        generate("multi-tenant", num_requests=10, seed=0), first_index=7, rid_prefix="r2-", max_tokens=3
    )
    assert [p.index for p in plan] == list(range(7, 17))
    assert all(p.rid.startswith("r2-mten-") and p.max_tokens == 3 for p in plan)
    assert all(p.after is None or 7 <= p.after < p.index for p in plan)


@pytest.mark.parametrize("num", [1, 2, 5, 100, 101])
def test_percentiles_match_numpy(num: int) -> None:
    values = list(np.random.default_rng(num).exponential(1.0, num))
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_arrivals_are_even_or_poisson_at_the_rate() -> None:
    rng = np.random.default_rng(0)
    assert arrival_offsets(3, None, "poisson", rng) == [0.0, 0.0, 0.0]
    assert arrival_offsets(3, 4.0, "even", rng) == [0.25, 0.25, 0.25]
    gaps = arrival_offsets(20000, 4.0, "poisson", rng)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)


def test_the_summary_has_the_documented_shape() -> None:
    ok = RequestResult(
        "a", "u0", True, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.2], prompt_tokens=10, cached_tokens=4, completion_tokens=3
    )
    failed = RequestResult("b", "u1", False, error="APIStatusError: 400 bad")
    summary = summarize(LoadReport("http://x", "tiny", 4, None, 3, 2.0, [ok, failed]))
    assert set(summary) == {
        "url",
        "model",
        "concurrency",
        "rate",
        "interrupted",
        "wall_s",
        "requests",
        "first_error",
        "throughput",
        "tokens",
        "ttft_s",
        "itl_s",
        "e2e_s",
    }
    assert summary["requests"] == {"planned": 3, "sent": 2, "completed": 1, "failed": 1}
    assert summary["first_error"] == "APIStatusError: 400 bad"
    assert summary["throughput"] == {"requests_per_s": 0.5, "output_tokens_per_s": 1.5, "prompt_tokens_per_s": 5.0}
    assert summary["tokens"] == {"prompt": 10, "cached": 4, "completion": 3, "cache_hit_rate": 0.4}
    assert set(summary["itl_s"]) == {"mean", "p50", "p90", "p99", "max"}
    assert summary["itl_s"]["p50"] == pytest.approx(0.15) and summary["e2e_s"]["max"] == 0.5
    json.dumps(summary)
    text = format_summary(summary)
    assert "1 of 3 requests completed, 1 failed" in text and "first error: APIStatusError: 400 bad" in text


def test_users_take_the_keys_round_robin_in_order_of_first_appearance(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": {"tenant": "acme", "user": "ann"}, "k2": {"tenant": "beta", "user": "bob"}}))
    keys = read_api_keys(path)
    assert keys == [ApiKey("k1", "acme", "ann"), ApiKey("k2", "beta", "bob")]
    driver = _Driver(LoadConfig("http://x", keys=keys), lambda _r: [], None)
    assert [driver.key_for(u) for u in ("u3", "u1", "u3", "u0")] == [keys[0], keys[1], keys[0], keys[0]]
    tenants = _Driver(LoadConfig("http://x", keys=keys), lambda _r: [], None)
    users = ("t2-u0", "t0-u1", "t2-u5", "t1-u0", "t0-u0")
    assert [tenants.key_for(u) for u in users] == [keys[0], keys[1], keys[0], keys[0], keys[1]]
    path.write_text("[1]")
    with pytest.raises(ValueError, match="expected a non-empty object"):
        read_api_keys(path)


def test_no_server_at_the_url_is_one_line_and_exit_2() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "kvscope", "load", "--url", url, "--workload", "multi-turn", "--num-requests", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvscope load: error: no server answers at {url}/v1")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real `kvscope serve` on a free loopback port, recording into a capture at level summary."""
    with serving(tmp_path_factory.mktemp("serve") / "serve.db", "--level", "summary") as server:
        yield server


def test_a_duration_repeats_the_workload_and_sigterm_prints_what_was_gathered() -> None:
    load = None
    with serving(None, "--level", "off") as server:
        try:
            url = server.url
            # --duration-s repeats the workload in rounds (seed + r, ids prefixed r{r}-) until the time is up
            small = LoadConfig(url=url, concurrency=4, duration_s=3.0)
            report = run_load(
                lambda r: generate("multi-turn", num_requests=8, seed=r, output_len=2), small, progress=None
            )
            assert all(r.ok for r in report.results) and len(report.results) > 8
            assert report.planned == len(report.results) and report.wall_s < 3.0 + 30
            assert {r.rid.split("-", 1)[0] for r in report.results} >= {"r0", "r1"}
            load = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvscope",
                    "load",
                    "--url",
                    url,
                    "--workload",
                    "multi-turn",
                    "--num-requests",
                    "2000",
                    "--concurrency",
                    "2",
                    "--json",
                    "--quiet",
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(6)
            load.send_signal(signal.SIGTERM)
            out, err = load.communicate(timeout=60)
            assert load.returncode == 143, err
            assert err.strip() == "kvscope load: interrupted"
            summary = json.loads(out)
            assert summary["interrupted"] is True
            assert summary["requests"]["completed"] < 2000 and summary["requests"]["failed"] == 0
        finally:
            if load is not None and load.poll() is None:
                load.kill()
                load.wait(timeout=10)


def test_load_replays_a_workload_against_kvscope_serve_and_the_capture_holds_every_request(served: Server) -> None:
    url, capture = served.url, served.capture
    # in-process: a session's next turn starts only after its previous turn finished
    trace = generate("multi-turn", num_requests=12, seed=5, output_len=4)
    report = run_load(lambda _r: trace, LoadConfig(url=url, concurrency=6), progress=None)
    assert all(r.ok for r in report.results), [r.error for r in report.results if not r.ok]
    by_rid = {r.rid: r for r in report.results}
    for planned in plan_requests(trace):
        if planned.after is not None:
            previous = by_rid[trace[planned.after].rid]
            assert previous.e2e_s is not None
            assert by_rid[planned.rid].start_s >= previous.start_s + previous.e2e_s
    # the verb: every request succeeds, the summary is the documented JSON
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "load",
            "--url",
            url,
            "--workload",
            "multi-tenant",
            "--num-requests",
            "16",
            "--concurrency",
            "4",
            "--max-tokens",
            "4",
            "--json",
            "--quiet",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    summary = json.loads(cli.stdout)
    assert summary["requests"] == {"planned": 16, "sent": 16, "completed": 16, "failed": 0}
    assert summary["tokens"]["completion"] == 16 * 4 and summary["tokens"]["cached"] > 0
    assert summary["ttft_s"]["p50"] > 0 and summary["e2e_s"]["p99"] >= summary["e2e_s"]["p50"]
    assert served.stop()[0] == 0
    # the capture: every request of both loads, with the workload's users as principals
    tenant = generate("multi-tenant", num_requests=16, seed=0)
    expected = sorted([(t.user, t.prompt_len) for t in trace] + [(t.user, t.prompt_len) for t in tenant])
    with contextlib.closing(sqlite3.connect(capture)) as db:
        rows = db.execute("SELECT principal, prompt_len, status FROM requests").fetchall()
        (status,) = db.execute("SELECT status FROM runs").fetchone()
    assert status == "finished"
    assert sorted((p, n) for p, n, _ in rows) == expected
    assert {s for _, _, s in rows} == {"finished"}


def test_with_api_keys_each_tenant_of_the_workload_sends_under_its_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"key-a": {"tenant": "acme", "user": "ann"}, "key-b": {"tenant": "beta", "user": "bob"}})
    )
    capture = tmp_path / "keyed.db"
    with serving(capture, "--api-keys", str(keys), "--level", "summary") as server:
        url = server.url
        args = [
            sys.executable,
            "-m",
            "kvscope",
            "load",
            "--url",
            url,
            "--workload",
            "multi-tenant",
            "--num-requests",
            "12",
            "--concurrency",
            "4",
            "--max-tokens",
            "2",
            "--json",
            "--quiet",
        ]
        keyless = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert keyless.returncode == 1
        assert json.loads(keyless.stdout)["first_error"].startswith("AuthenticationError")
        keyed = subprocess.run([*args, "--api-keys", str(keys)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert keyed.returncode == 0, keyed.stdout + keyed.stderr
        assert server.stop()[0] == 0
    trace = generate("multi-tenant", num_requests=12, seed=0)
    tenant_key: dict[str, str] = {}
    for t in trace:  # tenants in order of first appearance take the keys round-robin
        assert t.user is not None
        tenant_key.setdefault(t.user.split("-")[0], ("acme/ann", "beta/bob")[len(tenant_key) % 2])
    expected = sorted(f"{tenant_key[t.user.split('-')[0]]}/{t.user}" for t in trace if t.user is not None)
    with contextlib.closing(sqlite3.connect(capture)) as db:
        principals = sorted(p for (p,) in db.execute("SELECT principal FROM requests"))
    assert principals == expected
