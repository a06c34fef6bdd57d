"""One scrape of an engine's Prometheus `/metrics`, normalized into the numbers kvscope records.

    info = discover("http://127.0.0.1:30000")
    sample = scrape("http://127.0.0.1:30000", info)    # GET /metrics once
    sample.used_tokens, sample.cached_tokens_total       # None: the engine does not provide it

NOTE: where each field comes from (research note §3; None whenever the metric is absent, never 0):
    field                      SGLang (and kvscope serve, which uses SGLang's names)   vLLM
    capacity_tokens            sglang:max_total_num_tokens                 cache_config_info num_gpu_blocks x block_size
    available_tokens           sglang:kv_available_tokens (>= 0.5.18)      None (cached-but-free blocks count as free)
    evictable_tokens           sglang:kv_evictable_tokens (>= 0.5.18)      None
    used_tokens                sglang:kv_used_tokens, else num_used_tokens round(kv_cache_usage_perc x capacity)
    host_used/total_tokens     sglang:hicache_host_{used,total}_tokens     None
    num_running / num_waiting  sglang:num_running_reqs / num_queue_reqs    vllm:num_requests_running / _waiting
    prompt_tokens_total        sglang:prompt_tokens_total                  vllm:prefix_cache_queries_total
    cached_tokens_total        sglang:cached_tokens_total, every cache_source vllm:prefix_cache_hits_total
    host_cached_tokens_total   sglang:cached_tokens_total{cache_source="host"} None
    evicted_tokens_total       sglang:evicted_tokens_total                 None
    preemptions_total          None (num_retracted_reqs is a gauge)        vllm:num_preemptions_total
Label sets are summed: over `cache_source` (SGLang 0.5.23: device, host, storage; or "total" alone
when a request has no breakdown), and over data-parallel ranks (`dp_rank`; vLLM's `engine`), each
of which has a pool of its own. Samples labelled with a tensor/pipeline/expert rank other than 0
(SGLang's --enable-metrics-for-all-schedulers) repeat rank 0's view of the same pool and are skipped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscope.attach.errors import AttachError

if TYPE_CHECKING:
    from kvscope.attach.discover import EngineInfo

REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank")
VLLM_RANK_LABEL = "engine"

Labels = dict[str, str]
Samples = dict[str, list[tuple[Labels, float]]]  # sample name -> (labels, value) per label set


@dataclass(frozen=True)
class EngineSample:
    """One scrape of /metrics, normalized; None = the engine does not provide it."""

    t_wall: float
    capacity_tokens: int | None
    available_tokens: int | None
    evictable_tokens: int | None
    used_tokens: int | None
    host_used_tokens: int | None
    host_total_tokens: int | None
    num_running: int | None
    num_waiting: int | None
    prompt_tokens_total: int | None
    cached_tokens_total: int | None
    host_cached_tokens_total: int | None
    evicted_tokens_total: int | None
    preemptions_total: int | None


# -- HTTP (shared with discover.py) -------------------------------------------------------------


def http_get(client: httpx.Client, url: str) -> httpx.Response:
    """GET `url`; AttachError (one line) when nothing answers in HTTP. Any status comes back."""
    try:
        return client.get(url)
    except httpx.TimeoutException:
        raise AttachError(f"{url} did not answer within {client.timeout.read} s") from None
    except (httpx.ConnectError, httpx.UnsupportedProtocol, httpx.InvalidURL) as err:
        raise AttachError(f"cannot reach {url}: {one_line(err)}") from None
    except (httpx.RemoteProtocolError, httpx.DecodingError) as err:
        raise AttachError(f"{url} does not answer in HTTP: {one_line(err)}") from None
    except httpx.HTTPError as err:
        raise AttachError(f"GET {url} failed: {one_line(err)}") from None


def base_url(url: str) -> str:
    """`url` without a trailing slash; http:// is assumed when no scheme is given."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


# -- parsing ------------------------------------------------------------------------------------


def read_samples(text: str) -> Samples:
    """Every sample of a Prometheus text by sample name (counters keep their `_total`)."""
    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except ValueError as err:
        raise AttachError(f"/metrics is not Prometheus text: {one_line(err)}") from None
    return samples


def own_ranks(rows: Iterable[tuple[Labels, float]]) -> list[tuple[Labels, float]]:
    """The label sets of distinct pools: replicas of rank 0's view (tp/pp/ep rank > 0) dropped."""
    return [
        (labels, value)
        for labels, value in rows
        if all(labels.get(name, "0") == "0" for name in REPLICA_LABELS) and not math.isnan(value)
    ]


def total(samples: Samples, name: str, **match: str) -> int | None:
    """The sum of `name` over its label sets (those with every `match` label); None when it has none."""
    rows = [
        value
        for labels, value in own_ranks(samples.get(name, ()))
        if all(labels.get(key) == want for key, want in match.items())
    ]
    return round(sum(rows)) if rows else None


def vllm_capacity_by_engine(samples: Samples) -> dict[str, int]:
    """vLLM's cache_config_info per engine: num_gpu_blocks x block_size tokens (engines that say both)."""
    capacity: dict[str, int] = {}
    for labels, _ in samples.get("vllm:cache_config_info", ()):
        blocks, block_size = int_label(labels, "num_gpu_blocks"), int_label(labels, "block_size")
        if blocks is not None and block_size is not None:
            capacity[labels.get(VLLM_RANK_LABEL, "")] = blocks * block_size
    return capacity


def vllm_block_size(samples: Samples) -> int | None:
    for labels, _ in samples.get("vllm:cache_config_info", ()):
        block_size = int_label(labels, "block_size")
        if block_size is not None:
            return block_size
    return None


def int_label(labels: Labels, name: str) -> int | None:
    value = labels.get(name, "")
    return int(value) if value.isdigit() else None


def parse_metrics(text: str, engine: str, t_wall: float, info: EngineInfo) -> EngineSample:
    """The sample of one /metrics text of `engine` ("sglang", "kvscope" or "vllm")."""
    samples = read_samples(text)
    if engine in ("sglang", "kvscope"):
        return sglang_sample(samples, t_wall, info)
    if engine == "vllm":
        return vllm_sample(samples, t_wall, info)
    raise AttachError(f"cannot read the metrics of engine {engine!r}: expected sglang, vllm or kvscope")


def sglang_sample(samples: Samples, t_wall: float, info: EngineInfo) -> EngineSample:
    used = total(samples, "sglang:kv_used_tokens")
    capacity = total(samples, "sglang:max_total_num_tokens")
    return EngineSample(
        t_wall=t_wall,
        capacity_tokens=capacity if capacity is not None else info.capacity_tokens,
        available_tokens=total(samples, "sglang:kv_available_tokens"),
        evictable_tokens=total(samples, "sglang:kv_evictable_tokens"),
        used_tokens=used if used is not None else total(samples, "sglang:num_used_tokens"),
        host_used_tokens=total(samples, "sglang:hicache_host_used_tokens"),
        host_total_tokens=total(samples, "sglang:hicache_host_total_tokens"),
        num_running=total(samples, "sglang:num_running_reqs"),
        num_waiting=total(samples, "sglang:num_queue_reqs"),
        prompt_tokens_total=total(samples, "sglang:prompt_tokens_total"),
        cached_tokens_total=total(samples, "sglang:cached_tokens_total"),
        host_cached_tokens_total=total(samples, "sglang:cached_tokens_total", cache_source="host"),
        evicted_tokens_total=total(samples, "sglang:evicted_tokens_total"),
        preemptions_total=None,
    )


def vllm_sample(samples: Samples, t_wall: float, info: EngineInfo) -> EngineSample:
    by_engine = vllm_capacity_by_engine(samples)
    capacity = sum(by_engine.values()) if by_engine else info.capacity_tokens
    return EngineSample(
        t_wall=t_wall,
        capacity_tokens=capacity,
        available_tokens=None,
        evictable_tokens=None,
        used_tokens=vllm_used(samples, by_engine, capacity),
        host_used_tokens=None,
        host_total_tokens=None,
        num_running=total(samples, "vllm:num_requests_running"),
        num_waiting=total(samples, "vllm:num_requests_waiting"),
        prompt_tokens_total=total(samples, "vllm:prefix_cache_queries_total"),
        cached_tokens_total=total(samples, "vllm:prefix_cache_hits_total"),
        host_cached_tokens_total=None,
        evicted_tokens_total=None,
        preemptions_total=total(samples, "vllm:num_preemptions_total"),
    )


def vllm_used(samples: Samples, by_engine: dict[str, int], capacity: int | None) -> int | None:
    """Sum over engines of usage fraction x that engine's capacity (the whole capacity for a lone engine)."""
    rows = own_ranks(samples.get("vllm:kv_cache_usage_perc", ()))
    if not rows:
        return None
    used = 0
    for labels, fraction in rows:
        engine_capacity = by_engine.get(labels.get(VLLM_RANK_LABEL, ""))
        if engine_capacity is None:
            if len(rows) > 1 or capacity is None:
                return None  # no per-engine capacity to weigh this engine's fraction by
            engine_capacity = capacity
        used += round(fraction * engine_capacity)
    return used


# -- scraping -----------------------------------------------------------------------------------


def scrape(url: str, info: EngineInfo, timeout_s: float = 5.0) -> EngineSample:
    """GET `url`/metrics once and normalize it; AttachError (one line) on any failure."""
    metrics_url = base_url(url) + "/metrics"
    with httpx.Client(timeout=timeout_s) as client:
        response = http_get(client, metrics_url)
    if response.status_code != 200:
        hint = " (an SGLang server needs --enable-metrics)" if info.engine == "sglang" else ""
        raise AttachError(f"{metrics_url} answered HTTP {response.status_code}{hint}")
    return parse_metrics(response.text, info.engine, time.time(), info)
