"""`/metrics`: the scheduler's counters (its latest StatsOut) and the front's latency histograms,
in Prometheus text format on a registry of the server's own.

NOTE: names. Where SGLang exports the same quantity, the name is SGLang's (sglang:..., so an
SGLang Grafana dashboard reads kvscope unchanged); the rest are kvscope_*. docs/serve.md lists
them all. The token counters are the scheduler's running totals, exposed as counters through a
collector (a Counter cannot be set), so hit rate is a ratio of sums:
    rate(sglang:cached_tokens_total[1m]) / rate(sglang:prompt_tokens_total[1m])
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvscope.server.protocol import StatsOut

# per pool: (SGLang's prefix, pool label); kvscope's own protected count is labelled by pool
POOL_PREFIX = {"full": "sglang:kv", "swa": "sglang:swa"}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

GAUGES = (
    "sglang:kv_used_tokens", "sglang:kv_available_tokens", "sglang:kv_evictable_tokens",
    "sglang:swa_used_tokens", "sglang:swa_available_tokens", "sglang:swa_evictable_tokens",
    "sglang:max_total_num_tokens", "sglang:max_total_num_tokens_swa", "sglang:page_size",
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "kvscope_protected_tokens", "kvscope_scheduler_step",
)
COUNTERS = (
    "sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:generation_tokens_total",
    "sglang:evicted_tokens_total", "kvscope_retractions_total", "kvscope_leak_checks_passed_total",
    "kvscope_leak_checks_failed_total", "kvscope_requests_total",
)
HISTOGRAMS = (
    "sglang:queue_time_seconds", "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds",
)


class SchedulerCollector(Collector):
    """Gauges and counters from the latest StatsOut; nothing before the first one arrives."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.stats: StatsOut | None = None
        self.finished: dict[str, int] = {}  # finish_reason -> requests, counted by the front

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield _gauge("sglang:page_size", "tokens per KV page", self.page_size)
        requests = CounterMetricFamily("kvscope_requests", "requests finished, by finish reason", labels=["reason"])
        for reason, count in sorted(self.finished.items()):
            requests.add_metric([reason], count)
        yield requests
        if stats is None:
            return
        for pool, each in stats.pools.items():
            prefix = POOL_PREFIX.get(pool)
            if prefix is None:
                continue
            yield _gauge(f"{prefix}_used_tokens", f"{pool} pool: tokens in use and not evictable", each.used)
            yield _gauge(f"{prefix}_available_tokens", f"{pool} pool: free tokens", each.available)
            yield _gauge(f"{prefix}_evictable_tokens", f"{pool} pool: cached tokens no request locks",
                         each.evictable)
            total_name = "sglang:max_total_num_tokens" + ("" if pool == "full" else f"_{pool}")
            yield _gauge(total_name, f"{pool} pool: capacity in tokens", each.total)
        protected = GaugeMetricFamily("kvscope_protected_tokens", "cached tokens locked by running requests",
                                      labels=["pool"])
        for pool, each in stats.pools.items():
            protected.add_metric([pool], each.protected)
        yield protected
        yield _gauge("sglang:num_running_reqs", "requests running", stats.num_running)
        yield _gauge("sglang:num_queue_reqs", "requests waiting", stats.num_waiting)
        yield _gauge("kvscope_scheduler_step", "the scheduler's step counter", stats.step)
        yield _counter("sglang:prompt_tokens", "prompt tokens admitted", stats.prompt_tokens)
        cached = CounterMetricFamily("sglang:cached_tokens", "prompt tokens the prefix cache matched",
                                     labels=["source"])
        cached.add_metric(["device"], stats.cached_tokens)
        yield cached
        yield _counter("sglang:generation_tokens", "tokens generated", stats.generated_tokens)
        yield _counter("sglang:evicted_tokens", "tokens evicted from the prefix cache", stats.evicted_tokens)
        yield _counter("kvscope_retractions", "requests retracted (preempted) for memory", stats.num_retractions)
        yield _counter("kvscope_leak_checks_passed", "idle leak checks passed", stats.leak_checks_passed)
        yield _counter("kvscope_leak_checks_failed", "idle leak checks failed", stats.leak_checks_failed)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The server's registry: the scheduler collector and the front's histograms."""

    def __init__(self, page_size: int) -> None:
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerCollector(page_size)
        self.registry.register(self.scheduler)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.queue_time = histogram("sglang:queue_time_seconds", "arrival to first admission")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "arrival to the first generated token")
        self.itl = histogram("sglang:inter_token_latency_seconds", "between successive generated tokens")
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "arrival to the last token")

    def update(self, stats: StatsOut) -> None:
        self.scheduler.stats = stats

    def request_finished(self, reason: str) -> None:
        self.scheduler.finished[reason] = self.scheduler.finished.get(reason, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
