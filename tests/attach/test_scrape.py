"""parse_metrics on real vLLM 0.32.0 /metrics texts and on SGLang texts built from the documented
names (tests/attach/data/metrics/README.md); scrape over real loopback HTTP.

Every expected number below was read off the fixture text by hand, not computed by the code under test."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from kvscope.attach.discover import EngineInfo
from kvscope.attach.errors import AttachError
from kvscope.attach.scrape import EngineSample, parse_metrics, scrape
from tests.attach.loopback_http import closed_port_url, http_server, text_route, url_of

DATA = Path(__file__).parent / "data" / "metrics"
VLLM = EngineInfo("vllm", "0.32.0", "/tmp/vllm-model", 32, None, None, ())  # capacity: from the text
SGLANG = EngineInfo("sglang", "0.5.18", "Qwen/Qwen3-8B", 1, 5000, None, ())

FIELDS = [f.name for f in dataclasses.fields(EngineSample) if f.name != "t_wall"]


def read(name: str) -> str:
    return (DATA / name).read_text()


def fields_of(sample: EngineSample) -> dict[str, int | None]:
    return {name: getattr(sample, name) for name in FIELDS}


def vllm_expected(prompt: int, hits: int) -> dict[str, int | None]:
    # cache_config_info num_gpu_blocks="12" x block_size="32"; kv_cache_usage_perc 0.0; running, waiting,
    # preemptions 0.0 in all three captures
    return {
        "capacity_tokens": 384,
        "available_tokens": None,
        "evictable_tokens": None,
        "used_tokens": 0,
        "host_used_tokens": None,
        "host_total_tokens": None,
        "num_running": 0,
        "num_waiting": 0,
        "prompt_tokens_total": prompt,
        "cached_tokens_total": hits,
        "host_cached_tokens_total": None,
        "evicted_tokens_total": None,
        "preemptions_total": 0,
    }


@pytest.mark.parametrize(
    ("name", "prompt", "hits"),
    [
        ("vllm-0.32.0-idle.txt", 0, 0),  # prefix_cache_queries_total 0.0, prefix_cache_hits_total 0.0
        ("vllm-0.32.0-busy.txt", 600, 0),  # 600.0, 0.0
        ("vllm-0.32.0-hits.txt", 912, 128),  # 912.0, 128.0
    ],
)
def test_real_vllm_metrics_read_to_the_numbers_in_the_text(name: str, prompt: int, hits: int) -> None:
    sample = parse_metrics(read(name), "vllm", 123.5, VLLM)
    assert sample.t_wall == 123.5
    assert fields_of(sample) == vllm_expected(prompt, hits)


def test_vllm_used_tokens_is_the_usage_fraction_of_the_capacity() -> None:
    line = 'vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/vllm-model"} '
    text = read("vllm-0.32.0-hits.txt")
    assert line + "0.0\n" in text
    sample = parse_metrics(text.replace(line + "0.0\n", line + "0.25\n"), "vllm", 0.0, VLLM)
    assert sample.used_tokens == 96  # 0.25 x 384


def test_vllm_engines_each_weigh_their_fraction_by_their_own_capacity() -> None:
    text = "".join(
        f'vllm:cache_config_info{{block_size="32",engine="{e}",num_gpu_blocks="{blocks}"}} 1.0\n'
        f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {fraction}\n'
        f'vllm:prefix_cache_hits_total{{engine="{e}",model_name="m"}} {hits}\n'
        for e, blocks, fraction, hits in (("0", 12, 0.5, 64.0), ("1", 4, 0.25, 32.0))
    )
    sample = parse_metrics(text, "vllm", 0.0, VLLM)
    assert sample.capacity_tokens == 512  # 12 x 32 + 4 x 32
    assert sample.used_tokens == 224  # 0.5 x 384 + 0.25 x 128
    assert sample.cached_tokens_total == 96


def test_sglang_ranks_and_sources_are_summed_and_tp_copies_are_not() -> None:
    sample = parse_metrics(read("sglang-0.5.18-dp2.txt"), "sglang", 7.0, SGLANG)
    assert fields_of(sample) == {
        "capacity_tokens": 200000,  # dp 0: 100000, dp 1: 100000 (tp 1 repeats dp 0)
        "available_tokens": 130000,  # 60000 + 70000
        "evictable_tokens": 55000,  # 30000 + 25000
        "used_tokens": 15000,  # 10000 + 5000
        "host_used_tokens": 30000,  # 20000 + 10000
        "host_total_tokens": 400000,  # 200000 + 200000
        "num_running": 5,  # 3 + 2
        "num_waiting": 1,  # 1 + 0
        "prompt_tokens_total": 90000,  # 50000 + 40000
        "cached_tokens_total": 43500,  # 20000 + 5000 + 1000 + 15000 + 2500
        "host_cached_tokens_total": 7500,  # 5000 + 2500
        "evicted_tokens_total": 10000,  # 7000 + 3000
        "preemptions_total": None,  # num_retracted_reqs is a gauge
    }


def test_sglang_before_the_pool_split_leaves_the_split_unknown() -> None:
    sample = parse_metrics(read("sglang-0.5.10.txt"), "sglang", 7.0, SGLANG)
    assert fields_of(sample) == {
        "capacity_tokens": 8192,
        "available_tokens": None,
        "evictable_tokens": None,
        "used_tokens": 1234,  # num_used_tokens
        "host_used_tokens": None,
        "host_total_tokens": None,
        "num_running": 2,
        "num_waiting": 0,
        "prompt_tokens_total": 4096,
        "cached_tokens_total": 1024,
        "host_cached_tokens_total": None,  # only cache_source="device" is there
        "evicted_tokens_total": 512,
        "preemptions_total": None,
    }


def test_sglang_host_hits_are_read_from_the_cache_source_label() -> None:
    # SGLang 0.5.23's TokenizerMetricsCollector: labels model_name, engine_type (+ cache_source); one
    # sample per source that had hits, or cache_source="total" alone for a request with no breakdown
    labels = 'model_name="Qwen/Qwen3-8B",engine_type="unified"'
    text = (
        "# HELP sglang:cached_tokens_total Number of cached prompt tokens by source (device/host/storage).\n"
        "# TYPE sglang:cached_tokens_total counter\n"
        f'sglang:cached_tokens_total{{{labels},cache_source="device"}} 700.0\n'
        f'sglang:cached_tokens_total{{{labels},cache_source="host"}} 300.0\n'
    )
    sample = parse_metrics(text, "sglang", 0.0, SGLANG)
    assert (sample.cached_tokens_total, sample.host_cached_tokens_total) == (1000, 300)
    no_breakdown = f'sglang:cached_tokens_total{{{labels},cache_source="total"}} 1000.0\n'
    sample = parse_metrics(no_breakdown, "sglang", 0.0, SGLANG)
    assert (sample.cached_tokens_total, sample.host_cached_tokens_total) == (1000, None)


@pytest.mark.parametrize("engine", ["sglang", "kvscope", "vllm"])
def test_a_metric_that_is_missing_is_none_never_zero(engine: str) -> None:
    info = dataclasses.replace(SGLANG, engine=engine, capacity_tokens=5000)
    text = "# HELP unrelated_total something else\n# TYPE unrelated_total counter\nunrelated_total 3.0\n"
    sample = parse_metrics(text, engine, 1.0, info)
    assert sample.capacity_tokens == 5000  # from discovery when the text has none
    assert {name: value for name, value in fields_of(sample).items() if name != "capacity_tokens"} == dict.fromkeys(
        [name for name in FIELDS if name != "capacity_tokens"]
    )


def test_text_that_is_not_prometheus_is_one_line_error() -> None:
    with pytest.raises(AttachError, match="not Prometheus text") as caught:
        parse_metrics('<html>\n<body>sglang:kv_used_tokens{a="1" 3</body>\n</html>\n', "sglang", 0.0, SGLANG)
    assert "\n" not in str(caught.value)


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(AttachError, match="engine 'tgi'"):
        parse_metrics("", "tgi", 0.0, SGLANG)


def test_scrape_reads_metrics_over_http() -> None:
    text = read("sglang-0.5.18-dp2.txt")
    with http_server({"/metrics": text_route(text)}) as server:
        before = time.time()
        sample = scrape(url_of(server) + "/", SGLANG)
        after = time.time()
    assert server.asked == ["/metrics"]
    assert before <= sample.t_wall <= after
    assert fields_of(sample) == fields_of(parse_metrics(text, "sglang", 0.0, SGLANG))
    assert sample.used_tokens == 15000


def test_scrape_failures_are_one_line_errors() -> None:
    with http_server({}) as server, pytest.raises(AttachError, match=r"/metrics answered HTTP 404 .*--enable-metrics"):
        scrape(url_of(server), SGLANG)
    with pytest.raises(AttachError, match="cannot reach") as caught:
        scrape(closed_port_url(), SGLANG, timeout_s=2.0)
    assert "\n" not in str(caught.value)
