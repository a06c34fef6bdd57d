"""A real vLLM 0.32 CPU server under `kvscope instrument` (the probe loaded by vLLM's own plugin
loader in the EngineCore process), the session's one server (tests/engines/conftest.py), in phases
that run in this file's order after the attach test:
  1. clean workloads (shared prefix, distinct prompts, concurrent bursts, long prompts) in a pool of
     11 blocks, small enough that vLLM preempts: every census checks clean, the probe's lookups agree
     with vLLM's own /metrics counters, `kvscope check` finds every idle check balanced so far (the
     run still goes on, so its verdict is inconclusive, never clean);
  2. the capture's block events, replayed (kvscope/debug/census_replay.py), reproduce the stored
     census at each idle point;
  3. every dashboard page renders the capture (Streamlit AppTest);
  4. faults (the test-only plugin in tests/engines/faults): a reference kept on a finished request's
     block, a request's blocks freed twice: `kvscope check` exits 1 and `report leaks` names exactly
     the blocks and requests the plugin says it touched; the server stops and the run closes finished,
     still a leak. Last: after a double free vLLM's next use of those blocks would fail its own assert;
  5. alerts, before the server stops: a real Prometheus scrapes its /metrics with the shipped rule file
     (deploy/prometheus): every rule's and dashboard panel's query gets data, the leak alert fires for
     the faults' terms and no other alert does; then the server stops and the run closes finished.

Run by `make test-engines`; the server start takes minutes here, so it starts once per test run.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.debug.census_replay import replay_census
from kvscope.telemetry import Capture, EventKind
from tests.engines.conftest import ROOT, InstrumentedVllm
from tests.engines.prometheus import prometheus_server
from tests.engines.test_vllm_attach import counters, prompts
from tests.engines.vllm_server import VLLM_PYTHON

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    ),
]

PAGES = {
    "overview": "Overview",
    "memory": "Memory",
    "tiers": "Tiers",
    "tree": "Radix tree",
    "evictions": "Evictions",
    "leaks": "Leaks",
    "requests": "Requests",
    "capacity": "Capacity",
}


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )


def complete(url: str, prompt: list[int], max_tokens: int = 1, request_id: str | None = None, n: int = 1) -> None:
    """One completion of exactly `max_tokens` tokens (EOS ignored: random weights may pick it); `n` > 1:
    vLLM's parallel sampling, `n` requests the API server hands to the engine together."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    sampling = {"temperature": 0} if n == 1 else {"temperature": 1.0, "seed": 0, "n": n}
    response = httpx.post(
        f"{url}/v1/completions",
        headers={"X-Request-Id": request_id} if request_id else {},
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **sampling},
        timeout=300,
    )
    assert response.status_code == 200, response.text


def burst(url: str, batch: list[list[int]], max_tokens: int) -> None:
    """The prompts sent at once (a request each), waiting for all."""
    with ThreadPoolExecutor(len(batch)) as pool:
        list(pool.map(lambda p: complete(url, p, max_tokens), batch))


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(count)]


def last_steps(capture: Path) -> tuple[int, int]:
    """The last run's last usage step and last census step (the census follows the last step at idle)."""
    conn = sqlite3.connect(capture)
    try:
        ((run,),) = conn.execute("SELECT max(id) FROM runs").fetchall()
        ((usage,),) = conn.execute("SELECT max(step) FROM usage WHERE run_id = ?", (run,)).fetchall()
        ((census,),) = conn.execute("SELECT max(step) FROM leak_checks WHERE run_id = ?", (run,)).fetchall()
    finally:
        conn.close()
    return usage or 0, census or 0


def settle(capture: Path, timeout_s: float = 60.0) -> None:
    """Until the capture holds the census of the idle edge after the engine's last step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        usage, census = last_steps(capture)
        if usage and census >= usage:
            return
        time.sleep(0.5)
    raise AssertionError(f"no census after the last step within {timeout_s} s: {last_steps(capture)}")


def run_id(db: Capture) -> int:
    return int(db.runs().iloc[-1].id)


def test_clean_workloads_with_preemption_check_clean(instrumented_vllm: InstrumentedVllm) -> None:
    url, capture = instrumented_vllm.server.url, instrumented_vllm.capture
    rng = random.Random(29)
    sharing, distinct = prompts()
    for prompt in [*sharing, *distinct]:
        complete(url, prompt)  # shared prefix and distinct prompts, one at a time: each end is an idle edge
    prefix = tokens(rng, 64)
    burst(url, [prefix + tokens(rng, 40) for _ in range(4)], max_tokens=24)  # a shared prefix, concurrently
    burst(url, [tokens(rng, 80) for _ in range(6)], max_tokens=48)  # 6 x 4 blocks at the end: 24 > 11
    # NOTE: preemption for sure. The bursts above preempt only if their requests overlap in the engine, and this
    # tiny model finishes a request in less time than the API server takes to hand it the next one (two runs here
    # saw them arrive one by one). Parallel sampling hands the engine 4 requests at once; each grows from 2
    # blocks to 7 over 180 decode steps: 28 > 11
    complete(url, tokens(rng, 40), max_tokens=180, n=4)
    burst(url, [tokens(rng, 200) for _ in range(2)], max_tokens=40)  # long prompts: 2 x 8 blocks > 11
    settle(capture)
    metrics = counters(url)
    live = httpx.get(f"{url}/kvscope/census", timeout=30)
    assert live.status_code == 200, live.text
    [engine] = live.json()  # one EngineCore
    assert engine["ok"] and engine["blocks"] == 11 and engine["held"] == 0 and engine["violations"] == []

    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        source = json.loads(run.config)["source"]
        assert source["kind"] == "probe" and source["version"] == "0.32.0" and source["pid"] == engine["pid"]
        rid = run_id(db)
        assert len(db.events(rid, kinds=[EventKind.REQUEST_RETRACT], limit=None)) > 0, "the 11-block pool must preempt"
        assert len(db.events(rid, kinds=[EventKind.EVICT], limit=None)) > 0, "the 11-block pool must evict"
        checks = db.leak_checks(rid)
        assert checks.step.nunique() >= 4 and checks.ok.astype(bool).all(), checks[~checks.ok.astype(bool)]
        # vLLM counts a request's first lookup only (those after a preemption go to its preempted_* stats)
        matches = db.events(rid, kinds=[EventKind.MATCH], limit=None, columns=["rid", "num_tokens", "aux"])
        first = matches.drop_duplicates("rid")
        assert len(first) < len(matches)  # the preempted requests looked up again
        assert int(first.num_tokens.sum()) == metrics["vllm:prefix_cache_hits_total"] > 0
        assert int((first.num_tokens + first.aux).sum()) == metrics["vllm:prefix_cache_queries_total"]
        assert len(db.requests(rid)) == metrics["vllm:request_success_total"]
    finally:
        db.close()
    check = kvscope("check", str(capture))  # NOTE: the server still runs: `check` says clean only of a finished run
    assert check.returncode == 3, check.stdout + check.stderr
    assert re.search(
        r"inconclusive: the run is still running at step \d+; \d+ idle leak checks balanced so far", check.stdout
    ), check.stdout


def test_the_block_events_replay_to_the_census_at_each_idle_point(instrumented_vllm: InstrumentedVllm) -> None:
    db = Capture(instrumented_vllm.capture)
    try:
        points = replay_census(db, run_id(db))
    finally:
        db.close()
    assert len(points) >= 4
    assert all(p.agrees for p in points), [(p.step, p.differences()) for p in points if not p.agrees]
    assert any(p.replayed.evictable for p in points)  # cached blocks in the free queue: the replay kept hashes


@pytest.mark.parametrize("page", list(PAGES))
def test_every_dashboard_page_renders_the_capture(
    instrumented_vllm: InstrumentedVllm, page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = tmp_path / "probe.db"  # NOTE: a consistent copy: the server's recorder still writes the capture
    source, target = sqlite3.connect(instrumented_vllm.capture), sqlite3.connect(snapshot)
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()
    monkeypatch.setenv("KVSCOPE_DB", str(snapshot))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    if page != "overview":
        at.switch_page(f"kvscope/dashboard/app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(PAGES[page] in h.value for h in at.header), [h.value for h in at.header]


ALERT_RULES = ROOT / "deploy" / "prometheus" / "kvscope-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvscope-probe.json"
# NOTE: Grafana's variables as a query of every series would read them
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".+"}


def rule_queries(groups: list[Any]) -> list[str]:
    """Each alert's query, its comparison with a number cut off (the query must have data; the alert
    only while it holds)."""
    exprs = [rule["query"] for group in groups for rule in group["rules"]]
    assert all(rule["health"] == "ok" for group in groups for rule in group["rules"]), groups
    return [re.sub(r"\s*(>|<|==|!=|>=|<=)\s*[0-9.]+$", "", expr) for expr in exprs]


def dashboard_queries(path: Path) -> list[str]:
    dashboard = json.loads(path.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"].removeprefix("label_values(").split(",")[0])
    for name, value in GRAFANA_VARIABLES.items():
        exprs = [expr.replace(name, value) for expr in exprs]
    return exprs


def injected(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_injected_faults_are_named_exactly(instrumented_vllm: InstrumentedVllm) -> None:
    url, capture = instrumented_vllm.server.url, instrumented_vllm.capture
    rng = random.Random(31)
    for name in ("kvsfault-leak-a", "kvsfault-leak-b"):
        complete(url, tokens(rng, 100), request_id=name)  # 4 blocks each; one of them kept
    settle(capture)
    leaks = injected(instrumented_vllm.faults_log)
    assert [f["fault"] for f in leaks] == ["leak", "leak"] and all(len(f["blocks"]) == 1 for f in leaks)
    report = kvscope("report", "leaks", str(capture))
    leaked = {
        (int(b), rid)
        for b, rid in re.findall(r"block (\d+) ref 1, accounted 0; last taken by request (\S+) ", report.stdout)
    }
    assert leaked == {(f["blocks"][0], f["rid"]) for f in leaks}, report.stdout

    complete(url, tokens(rng, 100), request_id="kvsfault-dfree-a")
    settle(capture)
    [double] = [f for f in injected(instrumented_vllm.faults_log) if f["fault"] == "double-free"]
    live = httpx.get(f"{url}/kvscope/census", timeout=30).json()[0]
    assert sorted(live["leaked"]) == sorted(f["blocks"][0] for f in leaks) and live["lostref"] == double["blocks"]

    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert "Traceback" not in check.stdout + check.stderr
    report = kvscope("report", "leaks", str(capture))
    assert report.returncode == 0, report.stderr
    assert "verdict: leak (kvscope check exits 1)" in report.stdout
    last = report.stdout.split("last failure at step")[1].split("\nonset")[0]
    leaked = set(re.findall(r"block (\d+) ref 1, accounted 0; last taken by request (\S+) ", last))
    assert {(int(b), rid) for b, rid in leaked} == {(f["blocks"][0], f["rid"]) for f in leaks}, report.stdout
    released = set(re.findall(r"block (\d+) ref -1, accounted 0; last released for request (\S+) ", last))
    assert {(int(b), rid) for b, rid in released} == {(b, double["rid"]) for b in double["blocks"]}, report.stdout
    # NOTE: nothing else named (the report names each block twice: in its check's line and in the list of
    # every block the census named)
    named = {int(b) for b in re.findall(r"block (\d+) ref", last)}
    assert named == {f["blocks"][0] for f in leaks} | set(double["blocks"]), report.stdout

    db = Capture(capture)
    try:
        points = replay_census(db, run_id(db))
    finally:
        db.close()
    assert all(p.agrees for p in points), [(p.step, p.differences()) for p in points if not p.agrees]
    assert points[-1].replayed_terms["lostref"].num_blocks == len(double["blocks"])


def test_prometheus_gets_every_alert_and_dashboard_query_and_the_leak_alert_fires(
    instrumented_vllm: InstrumentedVllm,
) -> None:
    """After the faults: a real Prometheus scraping the server's /metrics with the shipped rule file."""
    server = instrumented_vllm.server
    target = server.url.removeprefix("http://")
    with prometheus_server([target], [ALERT_RULES], scrape_interval_s=1.0) as prom:
        prom.wait_for_scrape()
        prom.wait_for('kvscope_probe_up{engine="0"} == 1', timeout_s=60)
        prom.wait_for("kvscope_probe_censuses_total offset 3s", timeout_s=60)  # NOTE: two samples for rate()
        queries = rule_queries(prom.rule_groups()) + dashboard_queries(DASHBOARD)
        assert len(queries) >= 10
        for expr in queries:
            assert prom.query(expr), f"no data for {expr}"
        leaked = {s["metric"]["term"]: float(s["value"][1]) for s in prom.query("kvscope_probe_leaked_blocks")}
        assert leaked["leaked"] == 2 and leaked["lostref"] >= 1 and leaked["orphans"] == 0, leaked
        labels = prom.query("kvscope_probe_up")[0]["metric"]
        assert (labels["model_name"], labels["engine"]) == (server.model, "0"), labels
        vllm_labels = prom.query("vllm:num_requests_running")[0]["metric"]
        assert (vllm_labels["model_name"], vllm_labels["engine"]) == (labels["model_name"], labels["engine"])
        firing = prom.wait_for('ALERTS{alertname="KvscopeKVBlocksLeaked", alertstate="firing"}', timeout_s=60)
        assert {a["metric"]["term"] for a in firing} == {"leaked", "lostref"}, firing
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] != "KvscopeKVBlocksLeaked"], prom.alerts()


def test_the_run_closes_finished_and_stays_a_leak(instrumented_vllm: InstrumentedVllm) -> None:
    capture = instrumented_vllm.capture
    instrumented_vllm.stop()  # NOTE: the server's last phase: the run closes as finished, its verdict stays a leak
    db = Capture(capture)
    try:
        status = db.runs().iloc[-1].display_status
    finally:
        db.close()
    assert status == "finished", instrumented_vllm.log.read_text()[-4000:]
    check = kvscope("check", str(capture))
    assert check.returncode == 1 and "leak check failed" in check.stdout, check.stdout + check.stderr
