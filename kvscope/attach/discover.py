"""What runs behind a URL: SGLang, vLLM or kvscope's own server, its version, model, page size,
KV capacity and KV-event endpoint, and warnings for stream versions known to be wrong.

    info = discover("http://127.0.0.1:30000")          # engine="auto": SGLang, kvscope or vLLM
    info.engine, info.version, info.kv_events          # kv_events: where to subscribe, or None

NOTE: how each engine is told apart and read (research note §1.3, §3.3; GET of each path):
    /server_info (else /get_server_info)   JSON with "model_shape" and "pools"             -> kvscope serve
                                           JSON with a "version" string and server args  -> SGLang
    /version                               JSON {"version": "0.32.0"}                      -> vLLM
    /v1/models                             data[0].id is the model (all three)
    SGLang     block_size = page_size (else kv_events.block_size); capacity = max_total_num_tokens
    vLLM       block_size, capacity = num_gpu_blocks x block_size: /metrics vllm:cache_config_info
    kvscope    block_size = page_size; capacity = max_total_num_tokens (its full pool)
kv_events = {"endpoint", "replay_endpoint", "topic", "bind"}: SGLang >= 0.5.14 advertises a descriptor
(endpoint_host, endpoint_port_base, topic, replay_endpoint_port_base, dp_size); kvscope serve shows
its --kv-events-config. A wildcard host (*, 0.0.0.0, ::) is replaced by the URL's host. `bind` is
for the subscriber: True when the engine's PUB socket connects instead of binding (SGLang's rule:
it binds for a wildcard host or ipc:// / inproc://, and from 0.5.22 for 0.0.0.0 or "bind": true).
vLLM advertises nothing: kv_events is None and the endpoint is given by hand.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx

from kvscope.attach.errors import AttachError
from kvscope.attach.scrape import base_url, http_get, read_samples, vllm_block_size, vllm_capacity_by_engine

ENGINES = ("sglang", "vllm", "kvscope")
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")

NO_DISCOVERY = "no KV-event discovery in /server_info: give the event endpoint by hand"
# NOTE: SGLang version gates (research note §7): (first version that is fine, warning for those before it)
SGLANG_GATES = (
    ((0, 4, 8), "node-granular events: a stored block is a whole radix node, not a page"),
    ((0, 5, 3), "content hashes: repeated pages can alias one another in the rebuilt tree"),
    ((0, 5, 7), "split-remove bug: the rebuilt tree is unreliable; trust the metrics"),
    ((0, 5, 14), NO_DISCOVERY),  # 0.5.10 has no descriptor, 0.5.14 has: warned only when it is missing
)


@dataclass(frozen=True)
class EngineInfo:
    engine: str  # "sglang" | "vllm" | "kvscope"
    version: str | None
    model: str | None
    block_size: int | None  # tokens per page (SGLang page_size, vLLM block_size)
    capacity_tokens: int | None  # the device KV pool, in tokens
    kv_events: dict[str, Any] | None  # {"endpoint", "replay_endpoint", "topic", "bind"}, or None
    warnings: tuple[str, ...]  # one line each


def discover(url: str, *, engine: str = "auto", timeout_s: float = 5.0) -> EngineInfo:
    """Ask `url` what it is; AttachError (one line) when it is unreachable or answers as no known engine."""
    if engine != "auto" and engine not in ENGINES:
        raise AttachError(f"unknown engine {engine!r}: expected auto, {', '.join(ENGINES)}")
    root = base_url(url)
    with httpx.Client(timeout=timeout_s) as client:
        tried = []
        doc, status = server_info(client, root)  # NOTE: asked for vLLM too: kvscope serve answers /version as well
        kind = shape_of(doc)
        if doc is not None and kind is not None and engine in ("auto", kind):
            return sglang_info(client, root, doc) if kind == "sglang" else kvscope_info(client, root, doc)
        if kind is not None:
            raise AttachError(f"{root} is a {kind} server, not {engine}: use --engine {kind} or auto")
        if engine != "vllm":
            tried.append(f"an SGLang server (/server_info: {status})")
        if engine in ("auto", "vllm"):
            version, status = vllm_version(client, root)
            if version is not None:
                return vllm_info(client, root, version)
            tried.append(f"a vLLM server (/version: {status})")
    raise AttachError(f"{root} is not {' nor '.join(tried)}")


# -- asking -------------------------------------------------------------------------------------


def get_json(client: httpx.Client, url: str) -> tuple[Any, str]:
    """The JSON `url` answers with (None when it does not) and what came back, in words."""
    response = http_get(client, url)
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}"
    try:
        return response.json(), "HTTP 200"
    except ValueError:
        return None, "HTTP 200 but not JSON"


def server_info(client: httpx.Client, root: str) -> tuple[dict[str, Any] | None, str]:
    doc, status = get_json(client, root + "/server_info")
    if doc is None and status == "HTTP 404":
        doc, status = get_json(client, root + "/get_server_info")  # SGLang before /server_info
    return (doc, status) if isinstance(doc, dict) else (None, status if doc is None else "HTTP 200, another shape")


def shape_of(doc: dict[str, Any] | None) -> str | None:
    if doc is None:
        return None
    if "model_shape" in doc and "pools" in doc:
        return "kvscope"
    if isinstance(doc.get("version"), str) and any(
        key in doc for key in ("page_size", "max_total_num_tokens", "internal_states", "model_path")
    ):
        return "sglang"
    return None


def vllm_version(client: httpx.Client, root: str) -> tuple[str | None, str]:
    doc, status = get_json(client, root + "/version")
    if isinstance(doc, dict) and isinstance(doc.get("version"), str):
        return doc["version"], status
    return None, status if doc is None else "HTTP 200, another shape"


def model_id(client: httpx.Client, root: str) -> str | None:
    doc, _ = get_json(client, root + "/v1/models")
    try:
        first = doc["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return None
    return first if isinstance(first, str) else None


# -- one engine each ----------------------------------------------------------------------------


def sglang_info(client: httpx.Client, root: str, doc: dict[str, Any]) -> EngineInfo:
    version: str = doc["version"]
    descriptor = doc.get("kv_events") if isinstance(doc.get("kv_events"), dict) else None
    block_size = as_int(doc.get("page_size"))
    if block_size is None and descriptor is not None:
        block_size = as_int(descriptor.get("block_size"))
    config = parse_config(doc.get("kv_events_config"))
    events = sglang_events(descriptor, httpx.URL(root).host, version, config) if descriptor else None
    parsed = version_tuple(version)
    warnings = [
        f"SGLang {version}: {text}"
        for first_fine, text in SGLANG_GATES
        if parsed is not None and parsed < first_fine and not (text == NO_DISCOVERY and descriptor)
    ]
    dp_size = as_int(descriptor.get("dp_size")) if descriptor else None
    if events is not None and dp_size is not None and dp_size > 1:
        warnings.append(
            f"SGLang runs {dp_size} data-parallel ranks, each publishing on its own port from "
            f"{events['endpoint']}: only that first rank's stream is watched"
        )
    model = model_id(client, root) or text_or_none(doc.get("served_model_name")) or text_or_none(doc.get("model_path"))
    return EngineInfo(
        "sglang", version, model, block_size, as_int(doc.get("max_total_num_tokens")), events, tuple(warnings)
    )


def sglang_events(
    descriptor: dict[str, Any], url_host: str, version: str, config: dict[str, Any]
) -> dict[str, Any] | None:
    host, port = str(descriptor.get("endpoint_host", "")), as_int(descriptor.get("endpoint_port_base"))
    if port is None:
        return None
    parsed = version_tuple(version)
    newer = parsed is not None and parsed >= (0, 5, 22)
    publisher_binds = host in ("*", "::", "[::]", "") or (newer and (host == "0.0.0.0" or config.get("bind") is True))
    reachable = tcp_host(url_host) if host in WILDCARD_HOSTS else tcp_host(host)
    replay_port = as_int(descriptor.get("replay_endpoint_port_base"))
    return {
        "endpoint": f"tcp://{reachable}:{port}",
        "replay_endpoint": f"tcp://{reachable}:{replay_port}" if replay_port is not None else None,
        "topic": str(descriptor.get("topic") or ""),
        "bind": not publisher_binds,
    }


def kvscope_info(client: httpx.Client, root: str, doc: dict[str, Any]) -> EngineInfo:
    config = doc.get("kv_events")
    events = None
    if isinstance(config, dict) and config.get("publisher") == "zmq":
        url_host = httpx.URL(root).host
        endpoint = str(config.get("endpoint"))
        replay = config.get("replay_endpoint")
        events = {
            "endpoint": reachable_address(endpoint, url_host),
            "replay_endpoint": reachable_address(str(replay), url_host) if replay else None,
            "topic": str(config.get("topic") or ""),
            "bind": not publisher_binds_address(endpoint, config.get("bind")),
        }
    model = model_id(client, root) or text_or_none(doc.get("model"))
    return EngineInfo(
        "kvscope", None, model, as_int(doc.get("page_size")), as_int(doc.get("max_total_num_tokens")), events, ()
    )


def vllm_info(client: httpx.Client, root: str, version: str) -> EngineInfo:
    block_size = capacity = None
    response = http_get(client, root + "/metrics")
    if response.status_code == 200:
        try:
            samples = read_samples(response.text)
        except AttachError:
            samples = {}
        block_size = vllm_block_size(samples)
        by_engine = vllm_capacity_by_engine(samples)
        capacity = sum(by_engine.values()) if by_engine else None
    return EngineInfo("vllm", version, model_id(client, root), block_size, capacity, None, ())


# -- small readers ------------------------------------------------------------------------------


def version_tuple(version: str) -> tuple[int, int, int] | None:
    """(0, 5, 6) of "0.5.6.post1"; None for a version with no leading numbers."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def reachable_address(endpoint: str, url_host: str) -> str:
    """A ZMQ address with a wildcard tcp host replaced by the server's host (others unchanged)."""
    match = re.fullmatch(r"tcp://(\*|0\.0\.0\.0|\[::\]|::):(\d+)", endpoint)
    return f"tcp://{tcp_host(url_host)}:{match[2]}" if match else endpoint


def publisher_binds_address(endpoint: str, bind: object) -> bool:
    """SGLang >= 0.5.22's rule, which kvscope serve follows: does the PUB socket bind `endpoint`?"""
    if isinstance(bind, bool):
        return bind
    return endpoint.startswith(("ipc://", "inproc://")) or any(w in endpoint for w in ("*", "::", "0.0.0.0"))


def tcp_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_config(value: object) -> dict[str, Any]:
    """SGLang's server_args kv_events_config (a JSON string, or None); {} when it is not a JSON object."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def as_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
