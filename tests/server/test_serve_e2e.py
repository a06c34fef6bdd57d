"""`python -m kvscope serve` as a real subprocess on a free loopback port, driven by the official
openai client and httpx; the capture is read after SIGTERM closed it.

The tests of each server run in file order: the last one stops it and reads its capture.
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.telemetry import EventKind
from kvscope.telemetry.queries import Capture
from kvscope.workloads.tokenizer import ByteTokenizer
from tests.server.grafana import Selector, exprs, selectors, template_labels
from tests.server.serving import Server, serving

MODEL = "kvscope-tiny"
DASHBOARD = Path(__file__).parent / "data" / "sglang-dashboard.json"  # SGLang's, see data/README.md
KEYS = {"k-acme-alice": {"tenant": "acme", "user": "alice"}, "k-beta-bob": {"tenant": "beta", "user": "bob"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("open") / "serve.db") as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    with serving(
        tmp / "serve.db",
        "--api-keys",
        str(tmp / "keys.json"),
        "--level",
        "full",
        "--cache",
        "scoped-radix",
        "--promote-k",
        "inf",
    ) as srv:
        yield srv


def rid_of(response_id: str) -> str:
    return response_id.split("-", 1)[1]


IDENTITY = {"model_name": MODEL, "engine_type": "unified"}  # on SGLang's scheduler and tokenizer series


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, by name and labels (the identity labels checked and left out)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("sglang:evicted_tokens"):  # NOTE: the radix cache's labels, as SGLang's
                ranks = {k: sample.labels[k] for k in ("tp_rank", "pp_rank", "dp_rank")}
                assert ranks == dict.fromkeys(ranks, "0") and sample.labels["cache_type"].endswith("Cache"), sample
                out[sample.name] = sample.value
                continue
            if sample.name.startswith("sglang:"):
                assert {k: sample.labels.get(k) for k in IDENTITY} == IDENTITY, sample
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in IDENTITY)
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_idle(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once no request runs or waits and the scheduler has sent its idle stats."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = metrics(url)
        if values.get("sglang:num_running_reqs") == 0 and values.get("sglang:num_queue_reqs") == 0:
            time.sleep(1.0)  # one more stats interval, so the counters include the last step
            return metrics(url)
        time.sleep(0.2)
    raise AssertionError("the server did not go idle")


# --- the open server (no keys), level full


def test_completions_text_and_ids(server: Server) -> None:
    client = server.client()
    text = client.completions.create(model=MODEL, prompt="The pools fill up", max_tokens=8, user="carol")
    assert text.choices[0].finish_reason == "length"
    assert text.usage is not None and text.usage.completion_tokens == 8
    assert text.usage.prompt_tokens == len(ByteTokenizer().encode("The pools fill up"))
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.usage.completion_tokens == 4
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The pools fill up", max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text.choices[0].text  # the tiny model is deterministic (greedy)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    server.seen["rids"] = [rid_of(text.id), rid_of(by_ids.id), rid_of(chunks[0].id)]


def test_chat_streamed_and_not(server: Server) -> None:
    client = server.client()
    messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage is not None and plain.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_prompt_hits_the_cache(server: Server) -> None:
    client = server.client()
    prompt = "A long shared system prompt that the radix cache should keep between requests. " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens > len(prompt) // 2
    server.seen["cached"] = (rid_of(second.id), details.cached_tokens)


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": [1, "x"]}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": [100000]}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "5.5"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x" * 3000, "max_tokens": 4}).encode(), 400, "prompt"),  # leaves no room
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": MODEL, "prompt": "hi", "user": 7}).encode(), 400, "user"),
]


def test_malformed_requests_get_openai_errors_and_the_server_survives(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body, status, param in BAD:
            reply = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert reply.status_code == status, (body, reply.text)
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body, error)
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": ["user"]}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].role"
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404 and "error" in missing.json()
        for i in range(1000):
            body, status, _ = BAD[i % len(BAD)]
            reply = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert reply.status_code == status
    good = server.client().completions.create(model=MODEL, prompt="still here", max_tokens=3)
    assert good.usage is not None and good.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="no-such-model", prompt="hi", max_tokens=1)


def test_models_health_server_info(server: Server) -> None:
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["page_size"] == 1 and info["max_total_num_tokens"] == 4096 and info["cache"] == "radix"
    assert info["model_shape"]["num_layers"] >= 1 and info["pools"]["full"]["total"] == 4096


def test_client_closing_mid_stream_aborts(server: Server) -> None:
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "go on and on", "max_tokens": 1500, "stream": True},
        ) as reply,
    ):
        lines = reply.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = rid_of(json.loads(first[len("data: ") :])["id"])
    server.seen["aborted"] = rid
    values = wait_idle(server.url)
    assert values["kvscope_requests_total{reason=abort}"] == 1
    with pytest.raises(httpx.TimeoutException):  # a plain (not streamed) request whose client gives up
        httpx.post(
            f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "wait", "max_tokens": 1500}, timeout=1.0
        )
    values = wait_idle(server.url)
    assert values["kvscope_requests_total{reason=abort}"] == 2
    assert values["sglang:kv_used_tokens"] == 0 and values["kvscope_protected_tokens{pool=full}"] == 0
    assert values["sglang:kv_available_tokens"] + values["sglang:kv_evictable_tokens"] == 4096


Series = list[tuple[str, dict[str, str]]]


def matches(labels: dict[str, str], matcher: tuple[str, str, str], variables: dict[str, list[str]]) -> bool:
    """One label matcher against a series' labels; a `$variable` value takes the variable's first value."""
    label, op, value = matcher
    if value.startswith("$"):
        value = re.escape(variables[value[1:]][0])
    have = labels.get(label, "")
    found = have == value if op in ("=", "!=") else re.fullmatch(value, have) is not None
    return found if op in ("=", "=~") else not found


def selected(selector: Selector, series: Series, variables: dict[str, list[str]]) -> bool:
    return any(
        name == selector.metric and all(matches(labels, m, variables) for m in selector.matchers)
        for name, labels in series
    )


def test_sglang_grafana_dashboard_finds_every_series(server: Server) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    wait_idle(server.url)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    series = [(s.name, dict(s.labels)) for f in text_string_to_metric_families(text) for s in f.samples]
    # NOTE: instance is the scrape target's label, which Prometheus adds to every series; no exporter does
    variables = {
        label: sorted({labels[label] for _, labels in series if label in labels})
        for label in template_labels(dashboard)
        if label != "instance"
    }
    assert variables == {"model_name": [MODEL]}
    queries = exprs(dashboard)
    assert len(queries) == 14
    missing = [
        f"{selector.metric}{list(selector.matchers)} in {expr.strip()!r}"
        for expr in queries
        for selector in selectors(expr)
        if not selected(selector, series, variables)
    ]
    assert missing == []
    values = metrics(server.url)  # SGLang's definitions
    assert values["sglang:token_usage"] == round(
        values["sglang:kv_used_tokens"] / values["sglang:max_total_num_tokens"], 2
    )
    assert 0 <= values["sglang:cache_hit_rate"] <= 1 and values["sglang:gen_throughput"] >= 0


def test_sigterm_finishes_the_capture_and_metrics_agree(server: Server) -> None:
    values = wait_idle(server.url)
    started, streamed = threading.Event(), queue.Queue[tuple[str, str | None, int]]()

    def in_flight() -> None:  # a stream that is running when SIGTERM arrives: it is finished, not cut
        chunks = server.client().completions.create(
            model=MODEL, prompt="drain me", max_tokens=24, stream=True, stream_options={"include_usage": True}
        )
        rid, reason, completion = "", None, 0
        for chunk in chunks:
            started.set()
            rid = rid_of(chunk.id)
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
        streamed.put((rid, reason, completion))

    threading.Thread(target=in_flight, daemon=True).start()
    assert started.wait(30)
    code, printed = server.stop()
    drained_rid, reason, completion = streamed.get(timeout=30)
    assert (reason, completion) == ("length", 24)
    assert code == 0, printed
    assert "kvscope serve: stopped (SIGTERM)" in printed
    # NOTE: its leak report is stored at the end, as `run` stores its own (the dashboard reads it, no replay)
    assert "kvscope serve: run 1: clean: " in printed and printed.rstrip().endswith("(stored in the capture)")
    with sqlite3.connect(server.capture) as db:
        status, config = db.execute("select status, config from runs").fetchone()
        assert status == "finished"
        assert db.execute("select count(*) from reports where run_id = 1").fetchone()[0] >= 1
    stored = json.loads(config)  # the engine, model and machine, as `kvscope run` stores them
    assert stored["engine"]["torch_threads"] == max(1, len(os.sched_getaffinity(0)) - 1)  # auto on the CPU
    assert stored["model"]["vocab_size"] == 512 and stored["environment"]["device"] == "cpu"
    with sqlite3.connect(server.capture) as db:
        rows = {
            rid: (st, prompt, cached, out)
            for rid, st, prompt, cached, out in db.execute(
                "select rid, status, prompt_len, cached_tokens, output_len from requests"
            )
        }
        last_check = db.execute("select ok, step from leak_checks order by step desc limit 1").fetchone()
        aborted_step = db.execute(
            "select finish_step from requests where rid = ?", (server.seen["aborted"],)
        ).fetchone()
    assert last_check[0] == 1 and last_check[1] >= aborted_step[0]
    for rid in server.seen["rids"]:  # type: ignore[attr-defined]
        assert rows[rid][0] == "finished"
    assert rows.pop(drained_rid) == ("finished", len(ByteTokenizer().encode("drain me")), 0, 24)
    assert rows[str(server.seen["aborted"])][0] == "aborted"
    cached_rid, cached = cast(tuple[str, int], server.seen["cached"])
    assert rows[cached_rid][2] == cached
    assert values["sglang:prompt_tokens_total"] == sum(r[1] for r in rows.values())
    assert values["sglang:cached_tokens_total{cache_source=device}"] == sum(r[2] for r in rows.values())
    # the engine counts the output of finished requests (EngineStats.generated_tokens)
    assert values["sglang:generation_tokens_total"] == sum(r[3] for r in rows.values() if r[0] == "finished")
    assert values["kvscope_leak_checks_failed_total"] == 0
    num_finished = sum(r[0] == "finished" for r in rows.values())
    assert values["sglang:e2e_request_latency_seconds_count"] == num_finished  # aborted ones have no end
    assert values["sglang:time_to_first_token_seconds_count"] >= num_finished
    assert values["kvscope_requests_total{reason=length}"] == num_finished


# --- the keyed server (--api-keys), level full


def test_api_keys_401_403_and_narrowing(keyed: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        keyed.client("wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)
    no_key = httpx.post(f"{keyed.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    alice = keyed.client("k-acme-alice")
    for user in ("beta/bob", "acme/mallory", "acme/alice2/x"):
        with pytest.raises(openai.PermissionDeniedError):
            alice.completions.create(model=MODEL, prompt="hi", max_tokens=1, user=user)
    prompt = "tenant acme's own shared prefix, long enough to stay in the tree " * 2
    narrowed = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=2, user="sub1")
    plain = keyed.client("k-beta-bob").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "bob's question"}], max_tokens=2
    )
    keyed.seen["principals"] = {rid_of(narrowed.id): "acme/alice/sub1", rid_of(plain.id): "beta/bob"}
    # T7: the principal scopes the cache. The same prompt again hits for its principal (control);
    # for bob, or for alice without the narrowing suffix, it is another principal's: no hit
    again = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=1, user="sub1")
    bob = keyed.client("k-beta-bob").completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    wide = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage is not None and bob.usage is not None and wide.usage is not None
    cached = [
        u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        for u in (again.usage, bob.usage, wide.usage)
    ]
    assert cached[0] >= len(prompt) - 1 and cached[1:] == [0, 0], cached
    keyed.seen["matched"] = {rid_of(again.id): "acme/alice/sub1", rid_of(bob.id): "beta/bob"}


def principals_of(capture: Path, kind: EventKind) -> dict[str, str | None]:
    """rid -> principal of the capture's events of `kind` (the last one per rid)."""
    frame = Capture(capture).events(1, kinds=[kind], limit=None, columns=["rid", "principal"])
    return {rid: None if pd.isna(p) else p for rid, p in zip(frame.rid, frame.principal, strict=True)}


def test_principals_reach_the_capture(keyed: Server) -> None:
    wait_idle(keyed.url)
    code, printed = keyed.stop()
    assert code == 0, printed
    with sqlite3.connect(keyed.capture) as db:
        principals = dict(db.execute("select rid, principal from requests").fetchall())
        owners = {owner for (owner,) in db.execute("select distinct owner from tree_snapshots")}
        inserted = principals_of(keyed.capture, EventKind.INSERT)
        matched = principals_of(keyed.capture, EventKind.MATCH)
        visibility = set(db.execute("select distinct owner, visibility from tree_snapshots where owner is not null"))
    db.close()
    for rid, principal in keyed.seen["matched"].items():  # type: ignore[attr-defined]
        assert matched[rid] == principal  # the principal reached match_prefix
    assert ("acme/alice/sub1", "private") in visibility and ("beta/bob", "private") in visibility
    assert {v for _, v in visibility} == {"private"}  # --promote-k inf: nothing was ever promoted
    expected: dict[str, str] = keyed.seen["principals"]  # type: ignore[assignment]
    for rid, principal in expected.items():
        assert principals[rid] == principal and inserted[rid] == principal  # the request row and its insert event
    assert {"acme/alice/sub1", "beta/bob"} <= owners
    # the dashboard's Requests table shows each request's principal
    from streamlit.testing.v1 import AppTest

    root = Path(__file__).resolve().parents[2]
    os.environ["KVSCOPE_DB"] = str(keyed.capture)
    try:
        at = AppTest.from_file(str(root / "app.py"), default_timeout=60)
        at.switch_page("kvscope/dashboard/app_pages/requests.py")
        at.run()
    finally:
        del os.environ["KVSCOPE_DB"]
    assert not at.exception, [e.value for e in at.exception]
    shown = {str(value) for frame in at.dataframe for value in frame.value.get("principal", [])}
    assert {"acme/alice/sub1", "beta/bob"} <= shown


# --- the command line


def test_bad_config_is_one_line_exit_2(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    (tmp_path / "bad.json").write_text("[1]")
    try:
        for args in (
            ["--model", "nope"],
            ["--page-size", "3"],
            ["--api-keys", str(tmp_path / "bad.json")],
            ["--kv-events-config", "{bad"],
            ["--port", str(port)],
            ["--port", "70000"],
            ["--api-keys", str(tmp_path / "missing.json")],
            ["--api-keys", str(tmp_path)],
            ["--torch-threads", "0"],
        ):
            done = subprocess.run(
                [sys.executable, "-m", "kvscope", "serve", "--device", "cpu", "--level", "off", *args],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 2, (args, done.stderr)
            assert done.stderr.startswith("kvscope serve: error: ") and done.stderr.count("\n") == 1, done.stderr
            assert "ready" not in done.stdout
    finally:
        taken.close()
