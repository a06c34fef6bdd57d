"""discover() against real servers: SGLang- and vLLM-shaped loopback HTTP servers (SGLang answers as
its releases do; the vLLM answers are captures of a real 0.32.0 server), kvscope's own `kvscope serve`,
and (marked `engines`) a real vLLM server. Bad URLs fail with one line."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from kvscope.attach.discover import EngineInfo, discover
from kvscope.attach.errors import AttachError
from kvscope.attach.scrape import scrape
from kvscope.attach.subscriber import EventSubscriber
from kvscope.attach.wire import Cleared
from tests.attach.loopback_http import (
    Route,
    closed_port_url,
    http_server,
    json_route,
    not_http_server,
    text_route,
    url_of,
)

METRICS = Path(__file__).parent / "data" / "metrics"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def sglang_routes(
    version: str,
    *,
    kv_events: dict[str, Any] | None = None,
    kv_events_config: str | None = None,
    path: str = "/server_info",
) -> dict[str, Route]:
    """What an SGLang server answers: server args, scheduler info, internal states and the version
    (research note §3.3); the kv_events descriptor only when given (SGLang >= 0.5.14)."""
    doc: dict[str, Any] = {
        "model_path": MODEL,
        "tokenizer_path": MODEL,
        "served_model_name": MODEL,
        "page_size": 16,
        "max_total_tokens": None,
        "kv_events_config": kv_events_config,
        "disable_radix_cache": False,
        "tp_size": 1,
        "dp_size": 1,
        "enable_metrics": True,
        "max_total_num_tokens": 81920,
        "max_req_input_len": 8186,
        "internal_states": [{"memory_usage": {"weight": 15.0, "kvcache": 10.0, "token_capacity": 81920, "graph": 0.5}}],
        "version": version,
    }
    if kv_events is not None:
        doc["kv_events"] = kv_events
    models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "sglang"}]}
    return {path: json_route(doc), "/v1/models": json_route(models)}


def descriptor(host: str, *, dp_size: int = 1) -> dict[str, Any]:
    return {
        "publisher": "zmq",
        "endpoint_host": host,
        "endpoint_port_base": 5557,
        "topic": "kv",
        "block_size": 16,
        "dp_size": dp_size,
        "replay_endpoint_port_base": 5558,
    }


def vllm_routes() -> dict[str, Route]:
    return {
        "/version": json_route({"version": "0.32.0"}),
        "/v1/models": json_route(json.loads((METRICS / "vllm-0.32.0-models.json").read_text())),
        "/metrics": text_route((METRICS / "vllm-0.32.0-idle.txt").read_text()),
    }


# -- SGLang ---------------------------------------------------------------------------------------


def test_sglang_0_5_10_is_found_without_an_event_endpoint() -> None:
    with http_server(sglang_routes("0.5.10")) as server:
        info = discover(url_of(server))
    assert info == EngineInfo(
        "sglang",
        "0.5.10",
        MODEL,
        16,
        81920,
        None,
        ("SGLang 0.5.10: no KV-event discovery in /server_info: give the event endpoint by hand",),
    )


def test_sglang_0_5_18_advertises_its_events_and_the_wildcard_becomes_the_url_host() -> None:
    config = '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv"}'
    with http_server(sglang_routes("0.5.18", kv_events=descriptor("*"), kv_events_config=config)) as server:
        info = discover(url_of(server).replace("127.0.0.1", "localhost"))
    assert info == EngineInfo(
        "sglang",
        "0.5.18",
        MODEL,
        16,
        81920,
        {
            "endpoint": "tcp://localhost:5557",
            "replay_endpoint": "tcp://localhost:5558",
            "topic": "kv",
            "bind": False,
        },
        (),
    )


@pytest.mark.parametrize(
    ("version", "host", "config", "endpoint", "bind"),
    [
        ("0.5.18", "10.1.2.3", '{"endpoint":"tcp://10.1.2.3:5557"}', "tcp://10.1.2.3:5557", True),  # its PUB connects
        ("0.5.18", "0.0.0.0", '{"endpoint":"tcp://0.0.0.0:5557"}', "tcp://127.0.0.1:5557", True),  # 0.0.0.0 connects
        ("0.5.23", "0.0.0.0", '{"endpoint":"tcp://0.0.0.0:5557"}', "tcp://127.0.0.1:5557", False),  # binds from 0.5.22
        ("0.5.23", "10.1.2.3", '{"endpoint":"tcp://10.1.2.3:5557","bind":true}', "tcp://10.1.2.3:5557", False),
    ],
)
def test_the_subscriber_binds_where_the_engine_connects(
    version: str, host: str, config: str, endpoint: str, bind: bool
) -> None:
    with http_server(sglang_routes(version, kv_events=descriptor(host), kv_events_config=config)) as server:
        events = discover(url_of(server)).kv_events
    assert events is not None
    assert (events["endpoint"], events["bind"]) == (endpoint, bind)


SPLIT = "split-remove bug: the rebuilt tree is unreliable; trust the metrics"
HASHES = "content hashes: repeated pages can alias one another in the rebuilt tree"
NODES = "node-granular events: a stored block is a whole radix node, not a page"
NO_DISCOVERY = "no KV-event discovery in /server_info: give the event endpoint by hand"


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.4.7", [NODES, HASHES, SPLIT, NO_DISCOVERY]),
        ("0.4.8", [HASHES, SPLIT, NO_DISCOVERY]),
        ("0.5.2", [HASHES, SPLIT, NO_DISCOVERY]),
        ("0.5.6.post1", [SPLIT, NO_DISCOVERY]),
        ("0.5.7", [NO_DISCOVERY]),
        ("0.5.14", []),
        ("0.5.23", []),
    ],
)
def test_known_bad_stream_versions_are_warned_of(version: str, expected: list[str]) -> None:
    with http_server(sglang_routes(version, path="/get_server_info")) as server:  # the old route works too
        info = discover(url_of(server))
    assert info.engine == "sglang"
    assert info.warnings == tuple(f"SGLang {version}: {text}" for text in expected)


def test_a_release_before_0_5_14_that_advertises_its_events_is_not_warned_of() -> None:
    with http_server(sglang_routes("0.5.12", kv_events=descriptor("*"))) as server:
        info = discover(url_of(server))
    assert info.kv_events is not None and info.warnings == ()


def test_data_parallel_ranks_are_warned_of() -> None:
    with http_server(sglang_routes("0.5.18", kv_events=descriptor("*", dp_size=4))) as server:
        info = discover(url_of(server))
    assert info.warnings == (
        "SGLang runs 4 data-parallel ranks, each publishing on its own port from "
        "tcp://127.0.0.1:5557: only that first rank's stream is watched",
    )


# -- vLLM (captured answers of a real 0.32.0 server) -----------------------------------------------


def test_vllm_is_found_by_its_version_and_sized_from_its_cache_config() -> None:
    with http_server(vllm_routes()) as server:
        info = discover(url_of(server))
    assert info == EngineInfo("vllm", "0.32.0", "/tmp/vllm-model", 32, 384, None, ())  # 12 blocks x 32
    assert server.asked[:2] == ["/server_info", "/get_server_info"]  # asked SGLang's shape first


def test_a_forced_engine_must_be_what_answers() -> None:
    with http_server({**sglang_routes("0.5.18"), **vllm_routes()}) as both:
        assert discover(url_of(both)).engine == "sglang"
        with pytest.raises(AttachError, match="is a sglang server, not kvscope: use --engine sglang or auto"):
            discover(url_of(both), engine="kvscope")
        # NOTE: what /server_info says it is wins over a /version any server may answer
        with pytest.raises(AttachError, match="is a sglang server, not vllm: use --engine sglang or auto"):
            discover(url_of(both), engine="vllm")
    with http_server(vllm_routes()) as vllm_only:
        assert discover(url_of(vllm_only), engine="vllm").engine == "vllm"
    with (
        http_server({}) as nothing,
        pytest.raises(AttachError, match=r"is not a vLLM server \(/version: HTTP 404\)$"),
    ):
        discover(url_of(nothing), engine="vllm")
    with pytest.raises(AttachError, match="unknown engine 'tgi'"):
        discover("http://127.0.0.1:1", engine="tgi")


# -- what is not an engine ------------------------------------------------------------------------


def one_line_error(url: str) -> str:
    with pytest.raises(AttachError) as caught:
        discover(url, timeout_s=2.0)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_an_unreachable_url_is_one_line() -> None:
    url = closed_port_url()
    assert one_line_error(url).startswith(f"cannot reach {url}/server_info: ")


def test_a_server_that_is_not_http_is_one_line() -> None:
    with not_http_server() as url:
        assert one_line_error(url).startswith(f"{url}/server_info does not answer in HTTP: ")


def test_an_http_server_that_is_neither_engine_is_one_line() -> None:
    with http_server({}) as server:
        assert one_line_error(url_of(server)) == (
            f"{url_of(server)} is not an SGLang server (/server_info: HTTP 404) nor a vLLM server (/version: HTTP 404)"
        )
    html = (200, "text/html", b"<html>hello</html>")
    with http_server({"/server_info": html, "/version": json_route({"name": "other"})}) as server:
        assert one_line_error(url_of(server)) == (
            f"{url_of(server)} is not an SGLang server (/server_info: HTTP 200 but not JSON) "
            "nor a vLLM server (/version: HTTP 200, another shape)"
        )


# -- kvscope serve ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port: int = probe.getsockname()[1]
    return port


def test_kvscope_serve_is_found_and_scraped() -> None:
    from tests.server.serving import serving

    port, replay_port = free_port(), free_port()
    config = json.dumps(
        {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    )
    with serving(None, "--kv-tokens", "2048", "--page-size", "4", "--kv-events-config", config) as server:
        with pytest.raises(AttachError, match="is a kvscope server, not vllm: use --engine kvscope or auto"):
            discover(server.url, engine="vllm")  # NOTE: it answers /version too; once read as "vllm 0.1.0"
        info = discover(server.url)
        assert info == EngineInfo(
            "kvscope",
            None,
            "kvscope-tiny",
            4,
            2048,
            {
                "endpoint": f"tcp://127.0.0.1:{port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                "topic": "kv",
                "bind": False,
            },
            (),
        )
        subscriber = EventSubscriber(
            info.kv_events["endpoint"],
            replay_endpoint=info.kv_events["replay_endpoint"],
            topic="kv",
            bind=info.kv_events["bind"],
        )
        try:
            assert subscriber.catch_up() >= 1  # the discovered replay endpoint answers
            first = subscriber.poll(1000)[0]
            assert (first.topic, first.seq, first.batch.events) == (b"kv", 0, (Cleared(),))  # the stream's start
        finally:
            subscriber.close()
        idle = scrape(server.url, info)
        assert (idle.capacity_tokens, idle.available_tokens, idle.evictable_tokens, idle.used_tokens) == (
            2048,
            2048,
            0,
            0,
        )
        assert (idle.prompt_tokens_total, idle.cached_tokens_total, idle.num_running, idle.num_waiting) == (0, 0, 0, 0)
        assert (idle.host_used_tokens, idle.host_cached_tokens_total, idle.preemptions_total) == (None, None, None)
        prompt = list(range(10, 50))
        cached = []
        for _ in range(2):
            answer = server.client().completions.create(model=info.model or "", prompt=prompt, max_tokens=1)
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
        after = wait_for(lambda: scrape(server.url, info), lambda s: s.prompt_tokens_total == 80)
        assert after.cached_tokens_total == sum(cached) > 0  # what the answers said they hit
        split = (after.available_tokens, after.evictable_tokens, after.used_tokens)
        assert None not in split and sum(split) == 2048  # type: ignore[arg-type]
        assert split[1] > 0  # type: ignore[operator]  # the prompt's pages stay cached


def wait_for(take: Any, done: Any, timeout_s: float = 30.0) -> Any:
    """take() until done(it) (the scheduler's stats reach /metrics a step later than the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = take()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
