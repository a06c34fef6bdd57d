"""SGLang's native routes on a real `python -m kvscope serve` subprocess: /generate (SGLang
0.5.23's request and reply shapes, plain and streamed), /health_generate (a real one-token
generation) and /flush_cache (the prefix cache emptied when nothing runs, as a reset in the
capture; refused or waited for while a request runs), on one rank and on two.

The tests of each server run in file order: the last one stops it and reads its capture.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import httpx
import pytest

from kvscope.telemetry import EventKind
from kvscope.telemetry.queries import Capture
from kvscope.workloads.tokenizer import ByteTokenizer
from tests.server.serving import Server, serving
from tests.server.test_serve_e2e import metrics, wait_idle

LONG = 1500  # output tokens: a request that runs for seconds on the tiny model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("native") / "serve.db", "--level", "full") as srv:
        yield srv


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("native-dp") / "serve.db", "--dp-size", "2") as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("native-keys")
    (tmp / "keys.json").write_text(json.dumps({"k-acme": {"tenant": "acme", "user": "alice"}}))
    with serving(tmp / "serve.db", "--api-keys", str(tmp / "keys.json")) as srv:
        yield srv


def generate(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, headers=headers, timeout=60)


def stream_events(url: str, body: dict[str, Any]) -> list[Any]:
    """Every `data:` event of a streamed /generate, [DONE] as the string."""
    events: list[Any] = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_generate_text_and_input_ids_answer_in_sglang_shape(server: Server) -> None:
    reply = generate(server.url, {"text": "hello there", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 6 and out["text"] == ByteTokenizer().decode(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len("hello there") and meta["completion_tokens"] == 6
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0 and meta["id"]
    by_ids = generate(
        server.url,
        {
            "input_ids": ByteTokenizer().encode("hello there").tolist(),
            "rid": "mine-1",
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0},
        },
    ).json()
    assert by_ids["meta_info"]["id"] == "mine-1"
    assert by_ids["meta_info"]["cached_tokens"] > 0  # the same prompt: the radix cache holds it now
    server.seen["prompt"] = "hello there"
    info = httpx.get(f"{server.url}/model_info", timeout=10).json()  # what bench_serving asks for its tokenizer
    assert info["model_path"] == "kvscope-tiny" and info["tokenizer_path"] is None


def test_a_stream_carries_everything_so_far_and_ends_with_done(server: Server) -> None:
    events = stream_events(
        server.url, {"text": "stream me", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    )
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    ids = [chunk["output_ids"] for chunk in chunks]
    assert all(later[: len(earlier)] == earlier for earlier, later in pairwise(ids))
    counts = [chunk["meta_info"]["completion_tokens"] for chunk in chunks]
    assert counts == [len(i) for i in ids] and counts == sorted(counts)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8} and len(last["output_ids"]) == 8
    assert last["text"] == ByteTokenizer().decode(last["output_ids"])


def test_stop_strings_and_tokens_end_the_reply_as_sglang_reports_them(server: Server) -> None:
    greedy = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    probe = generate(server.url, {"text": "abc", "sampling_params": greedy}).json()
    ids = probe["output_ids"]
    k = next(i for i, t in enumerate(ids) if 3 + 0x20 <= t < 3 + 0x7F and i >= 1)  # an ASCII byte, not the first
    stop = chr(ids[k] - 3)
    first = next(i for i, t in enumerate(ids) if t == ids[k])
    trimmed = generate(server.url, {"text": "abc", "sampling_params": {**greedy, "stop": stop}}).json()
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["output_ids"] == ids[: first + 1] and trimmed["text"] == ByteTokenizer().decode(ids[:first])
    kept = generate(server.url, {"text": "abc", "sampling_params": {**greedy, "stop": [stop], "no_stop_trim": True}})
    assert kept.json()["text"] == ByteTokenizer().decode(ids[: first + 1])
    by_token = generate(server.url, {"text": "abc", "sampling_params": {**greedy, "stop_token_ids": [ids[k]]}}).json()
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert by_token["output_ids"] == ids[: first + 1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "x", "return_logprob": True}, "return_logprob"),
        ({"text": "x", "lora_path": "adapter"}, "lora_path"),
        ({"text": "x", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"text": "x", "sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
        ({"text": "x", "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"no_such_knob": 1}}, "sampling_params.no_such_knob"),
        ({"text": "x", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 5000}}, "sampling_params.max_new_tokens"),
        ({"text": "x", "sampling_params": {"stop": ["ok", ""]}}, "sampling_params.stop"),
        ({"text": "x", "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
        ({"text": "x", "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
        ({"text": ["a", "b"]}, "text"),
        ({"text": "x", "input_ids": [5]}, "text"),
        ({"input_ids": [[5], [6]]}, "input_ids"),
        ({"input_ids": [99999]}, "input_ids"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_it(server: Server, body: dict[str, Any], param: str) -> None:
    reply = generate(server.url, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_neutral_and_ignored_fields_are_accepted(server: Server) -> None:
    body = {  # what SGLang's bench_serving sends, and a field that changes nothing here
        "text": "neutral",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True, "skip_special_tokens": False},
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
        "log_metrics": False,
    }
    reply = generate(server.url, body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["completion_tokens"] == 3


def test_health_generate_runs_one_token(server: Server) -> None:
    before = wait_idle(server.url)["sglang:generation_tokens_total"]
    reply = httpx.get(f"{server.url}/health_generate", timeout=30)
    assert reply.status_code == 200
    assert wait_idle(server.url)["sglang:generation_tokens_total"] == before + 1


def test_flush_cache_empties_the_cache_only_when_idle(server: Server) -> None:
    assert wait_idle(server.url)["sglang:kv_evictable_tokens"] > 0
    reply = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert reply.status_code == 200, reply.text
    values = wait_idle(server.url)
    assert values["sglang:kv_evictable_tokens"] == 0 and values["sglang:kv_available_tokens"] == 4096
    again = generate(server.url, {"text": server.seen["prompt"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert again["meta_info"]["cached_tokens"] == 0  # the flush forgot the prompt cached before
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST",
            f"{server.url}/generate",
            json={
                "text": "keep going",
                "stream": True,
                "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
            },
        ) as running,
    ):
        lines = running.iter_lines()  # NOTE: held, so the stream stays open (a dropped iterator closes it)
        next(line for line in lines if line.startswith("data: "))
        refused = httpx.post(f"{server.url}/flush_cache", timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "cache_not_flushed"
        assert "1 requests running" in refused.json()["error"]["message"]
    wait_idle(server.url)
    assert metrics(server.url)["sglang:kv_evictable_tokens"] > 0  # the refused flush changed nothing


def test_a_flush_with_a_timeout_waits_for_the_running_request(server: Server) -> None:
    wait_idle(server.url)
    ended: list[float] = []

    def run() -> None:
        generate(server.url, {"text": "a while", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
        ended.append(time.monotonic())

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while metrics(server.url).get("sglang:num_running_reqs", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    reply = httpx.get(f"{server.url}/flush_cache", params={"timeout": 60}, timeout=90)
    answered = time.monotonic()
    worker.join(60)
    assert reply.status_code == 200, reply.text
    assert ended and answered >= ended[0] - 0.5  # answered once the request was done, not before
    assert wait_idle(server.url)["sglang:kv_evictable_tokens"] == 0
    short = httpx.post(f"{server.url}/flush_cache", params={"timeout": "-1"}, timeout=30)
    assert short.status_code == 400 and short.json()["error"]["param"] == "timeout"


def test_the_capture_shows_the_flushes_as_resets_and_the_health_check(server: Server) -> None:
    wait_idle(server.url)
    code, printed = server.stop()
    assert code == 0, printed
    assert "request field 'log_metrics' is accepted and ignored" in printed
    assert "request field 'sampling_params.skip_special_tokens' is accepted and ignored" in printed
    capture = Capture(server.capture)
    evicts = capture.events(1, kinds=[EventKind.EVICT], limit=None, columns=["reason", "num_tokens"])
    assert (evicts.reason == "reset").sum() > 0
    rids = capture.requests(1).rid.tolist()
    assert "mine-1" in rids and any(rid.startswith("HEALTH_CHECK_") for rid in rids)


def wait_idle_ranks(url: str, num_ranks: int = 2, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once no rank runs or queues a request and each has sent its idle stats."""
    deadline = time.monotonic() + timeout_s
    names = [
        f"sglang:{name}{{dp_rank={r}}}" for name in ("num_running_reqs", "num_queue_reqs") for r in range(num_ranks)
    ]
    while time.monotonic() < deadline:
        if all(metrics(url).get(name) == 0 for name in names):
            time.sleep(1.0)  # one more stats interval
            return metrics(url)
        time.sleep(0.2)
    raise AssertionError("the ranks did not go idle")


def test_two_ranks_flush_both_caches_and_answer_the_health_check(fleet: Server) -> None:
    for i in range(4):  # round robin: two requests on each rank
        reply = generate(fleet.url, {"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 3}})
        assert reply.status_code == 200, reply.text
    values = wait_idle_ranks(fleet.url)
    assert all(values[f"sglang:kv_evictable_tokens{{dp_rank={r}}}"] > 0 for r in (0, 1)), values
    assert httpx.get(f"{fleet.url}/health_generate", timeout=30).status_code == 200
    assert httpx.post(f"{fleet.url}/flush_cache", timeout=30).status_code == 200
    values = wait_idle_ranks(fleet.url)
    assert all(values[f"sglang:kv_evictable_tokens{{dp_rank={r}}}"] == 0 for r in (0, 1)), values
    code, printed = fleet.stop()
    assert code == 0, printed


def test_with_keys_generate_and_flush_need_one_and_the_probe_does_not(keyed: Server) -> None:
    body = {"text": "who asks", "sampling_params": {"max_new_tokens": 2}}
    assert generate(keyed.url, body).status_code == 401
    assert httpx.post(f"{keyed.url}/flush_cache", timeout=30).status_code == 401
    assert httpx.get(f"{keyed.url}/health_generate", timeout=30).status_code == 200
    bearer = {"Authorization": "Bearer k-acme"}
    assert generate(keyed.url, body, bearer).status_code == 200
    assert httpx.post(f"{keyed.url}/flush_cache", headers=bearer, timeout=30).status_code == 200
    code, printed = keyed.stop()
    assert code == 0, printed
    assert keyed.capture is not None
    assert "acme/alice" in Capture(keyed.capture).requests(1).principal.tolist()
