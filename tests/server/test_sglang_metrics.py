"""`/metrics` computes SGLang 0.5.23's gauges with SGLang's definitions (its metrics_reporter and
pool_stats_observer, read in the released wheel): token_usage is the fullest pool's
(total - available - evictable) / total to 2 decimals; gen_throughput is the tokens generated
between two reports over the seconds between them, read as 0 once reports stop for 30 s;
cache_hit_rate is the hit share of the prompts admitted since the last report that admitted any
(a report with no new prompt keeps it, as SGLang's decode reports do). Host hits are labelled
cache_source="host", device hits "device"."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvscope.server.metrics import ReportRates, ServerMetrics, token_usage
from kvscope.server.protocol import PoolStats, StatsOut


def stats(
    prompt: int, cached: int, generated: int, host_hits: int | None = None, pools: dict[str, PoolStats] | None = None
) -> StatsOut:
    pools = pools or {"full": PoolStats(total=100, used=10, available=80, evictable=10, protected=5)}
    return StatsOut(
        step=1,
        pools=pools,
        num_running=0,
        num_waiting=0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        generated_tokens=generated,
        evicted_tokens=0,
        num_retractions=0,
        leak_checks_passed=0,
        leak_checks_failed=0,
        host_hit_tokens=host_hits,
    )


def test_token_usage_is_the_fullest_pools_used_share() -> None:
    full = PoolStats(total=1000, used=123, available=500, evictable=377, protected=0)
    swa = PoolStats(total=200, used=90, available=100, evictable=10, protected=0)
    assert token_usage({"full": full}) == 0.12
    assert token_usage({"full": full, "swa": swa}) == 0.45
    assert token_usage({"full": PoolStats(0, 0, 0, 0, 0)}) == 0.0


def test_gen_throughput_and_cache_hit_rate_follow_the_reports() -> None:
    rates = ReportRates(now_s=10.0)
    rates.update(stats(prompt=100, cached=0, generated=0), now_s=10.5)
    assert (rates.gen_throughput, rates.cache_hit_rate) == (0.0, 0.0)
    rates.update(stats(prompt=300, cached=150, generated=40), now_s=12.5)  # 200 new prompt tokens, 150 hit
    assert (rates.gen_throughput, rates.cache_hit_rate) == (20.0, 0.75)
    rates.update(stats(prompt=300, cached=150, generated=50), now_s=13.0)  # decode only: the hit rate stays
    assert (rates.gen_throughput, rates.cache_hit_rate) == (20.0, 0.75)
    assert rates.throughput(now_s=42.9) == 20.0
    assert rates.throughput(now_s=43.1) == 0.0  # no report for over 30 s


def test_cached_tokens_are_labelled_by_cache_source() -> None:
    def cached(host_hits: int | None) -> dict[str, float]:
        metrics = ServerMetrics(page_size=4, model_name="m")
        metrics.update(stats(prompt=1000, cached=1000, generated=0, host_hits=host_hits))
        families = text_string_to_metric_families(metrics.render().decode())
        return {
            s.labels["cache_source"]: s.value
            for f in families
            for s in f.samples
            if s.name == "sglang:cached_tokens_total"
        }

    assert cached(host_hits=300) == {"device": 700.0, "host": 300.0}
    assert cached(host_hits=None) == {"device": 1000.0}  # no host tier


def labels_of(metrics: ServerMetrics) -> dict[str, list[dict[str, str]]]:
    families = text_string_to_metric_families(metrics.render().decode())
    return {s.name: [dict(x.labels) for x in f.samples if x.name == s.name] for f in families for s in f.samples}


def test_each_family_carries_the_labels_of_the_sglang_collector_that_exports_it() -> None:
    """SGLang 0.5.23: the tokenizer's token totals and request latencies are one series per server (no
    dp_rank); the radix cache's evicted_tokens_total carries cache_type, tp_rank, pp_rank and dp_rank,
    not model_name; the scheduler's gauges and queue time carry dp_rank with several ranks."""
    metrics = ServerMetrics(page_size=4, model_name="m", dp_size=2, cache_kind="hiradix")
    for rank in (0, 1):
        metrics.update(stats(prompt=100, cached=40, generated=7, host_hits=10), rank)
        metrics.latency(rank).e2e.observe(0.5)
        metrics.latency(rank).queue_time.observe(0.1)
    found = labels_of(metrics)
    identity = {"model_name": "m", "engine_type": "unified"}
    for name in (
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:e2e_request_latency_seconds_count",
    ):
        assert found[name] == [identity], name
    assert sorted(s["cache_source"] for s in found["sglang:cached_tokens_total"]) == ["device", "host"]
    assert found["sglang:evicted_tokens_total"] == [
        {"cache_type": "HiRadixCache", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
    ]
    assert [s["dp_rank"] for s in found["sglang:num_running_reqs"]] == ["0", "1"]
    assert [s["dp_rank"] for s in found["sglang:queue_time_seconds_count"]] == ["0", "1"]
    text = metrics.render().decode()
    assert 'sglang:prompt_tokens_total{engine_type="unified",model_name="m"} 200.0' in text  # both ranks summed
    assert 'sglang:e2e_request_latency_seconds_count{engine_type="unified",model_name="m"} 2.0' in text
