"""`/metrics`: the scheduler's counters (its latest StatsOut) and the front's latency histograms,
in Prometheus text format on a registry of the server's own.

NOTE: names. Where SGLang exports the same quantity, the name, the definition and the labels are
SGLang 0.5.23's (sglang:..., each series labelled model_name and engine_type="unified", as SGLang
labels its own); the rest are kvscope_*. docs/serve.md lists them all, and
tests/server/test_grafana_dashboard.py checks SGLang's published Grafana dashboard against them.
"used" is SGLang's: total - available - evictable. The token counters are the scheduler's running
totals, exposed as counters through a collector (a Counter cannot be set), so hit rate over a
window is a ratio of sums:
    sum(rate(sglang:cached_tokens_total[1m])) / sum(rate(sglang:prompt_tokens_total[1m]))
NOTE: labels follow which of SGLang 0.5.23's collectors exports the family:
    scheduler   (gauges, queue time, kvscope_*)          model_name, engine_type; with
                `serve --dp-size N` (N > 1) also dp_rank ("0" .. "N-1"), one series per replica,
                and kvscope_scheduler_up{dp_rank} is 1 while the rank's process lives, 0 once it died
    tokenizer   (prompt/cached/generation token totals,  model_name, engine_type only: SGLang's one
                time to first token, inter-token and     tokenizer manager sees every rank's
                end-to-end latency)                      requests, so one series for the server
    radix cache (evicted_tokens_total)                   cache_type (the cache's class name),
                tp_rank, pp_rank, dp_rank: "0" each (SGLang's ranks without DP attention), summed
                over the server's replicas as SGLang's multiprocess registry sums its processes
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvscope.server.protocol import PoolStats, StatsOut

# per pool: (SGLang's prefix, pool label); kvscope's own protected count is labelled by pool
POOL_PREFIX = {"full": "sglang:kv", "swa": "sglang:swa"}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
IDENTITY_LABELS = ("model_name", "engine_type")  # on the scheduler's and tokenizer's sglang:* series
CACHE_LABELS = ("cache_type", "tp_rank", "pp_rank", "dp_rank")  # on the radix cache's (evicted_tokens_total)
# kvscope's cache kind -> the class name SGLang labels its cache series with (scoped-radix is kvscope's own)
SGLANG_CACHE_TYPES = {
    "radix": "RadixCache",
    "swa-radix": "SWARadixCache",
    "hiradix": "HiRadixCache",
    "chunk": "ChunkCache",
    "none": "ChunkCache",
    "scoped-radix": "ScopedRadixCache",
}
RANK_LABEL = "dp_rank"  # on every series of a server with several data-parallel ranks
AUTO_KIND = "auto"  # the engine's --cache auto (kvscope.engine.AUTO; the server layer only reads its name)
ENGINE_TYPE = "unified"  # SGLang's engine_type of a server that is neither a prefill nor a decode node
GEN_THROUGHPUT_STALE_S = 30.0  # SGLang reads gen_throughput as 0 once no report came for 30 s

GAUGES = (
    "sglang:kv_used_tokens",
    "sglang:kv_available_tokens",
    "sglang:kv_evictable_tokens",
    "sglang:swa_used_tokens",
    "sglang:swa_available_tokens",
    "sglang:swa_evictable_tokens",
    "sglang:max_total_num_tokens",
    "sglang:max_total_num_tokens_swa",
    "sglang:page_size",
    "sglang:token_usage",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "kvscope_protected_tokens",
    "kvscope_scheduler_step",
)
COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:evicted_tokens_total",
    "kvscope_retractions_total",
    "kvscope_leak_checks_passed_total",
    "kvscope_leak_checks_failed_total",
    "kvscope_requests_total",
)
HISTOGRAMS = (
    "sglang:queue_time_seconds",
    "sglang:time_to_first_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds",
)


class ReportRates:
    """SGLang's two per-report gauges, from successive StatsOut:
    gen_throughput  tokens generated since the previous report / the seconds between the two
                    (0 once no report came for GEN_THROUGHPUT_STALE_S)
    cache_hit_rate  cached / prompt tokens of the requests admitted since the previous report;
                    kept while none is admitted (SGLang sets it per prefill batch, not per decode)"""

    def __init__(self, now_s: float) -> None:
        self.last_s = now_s
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.gen_throughput = 0.0
        self.cache_hit_rate = 0.0

    def update(self, stats: StatsOut, now_s: float) -> None:
        elapsed_s = now_s - self.last_s
        if elapsed_s > 0:
            self.gen_throughput = (stats.generated_tokens - self.num_generated_tokens) / elapsed_s
        new_prompt_tokens = stats.prompt_tokens - self.num_prompt_tokens
        if new_prompt_tokens > 0:
            self.cache_hit_rate = (stats.cached_tokens - self.num_cached_tokens) / new_prompt_tokens
        self.last_s = now_s
        self.num_generated_tokens, self.num_prompt_tokens = stats.generated_tokens, stats.prompt_tokens
        self.num_cached_tokens = stats.cached_tokens

    def throughput(self, now_s: float) -> float:
        return 0.0 if now_s - self.last_s > GEN_THROUGHPUT_STALE_S else self.gen_throughput


def token_usage(pools: dict[str, PoolStats]) -> float:
    """SGLang's token_usage: the fullest pool's used / total (used = total - available - evictable), 2 decimals."""
    return round(max((each.used / each.total for each in pools.values() if each.total > 0), default=0.0), 2)


class SchedulerCollector(Collector):
    """Gauges and counters from the latest StatsOut of one scheduler (`dp_rank`: its label, None
    for a server with one rank); nothing before the first one arrives."""

    def __init__(self, page_size: int, model_name: str, dp_rank: int | None = None) -> None:
        self.page_size = page_size
        self.rank_names = [] if dp_rank is None else [RANK_LABEL]
        self.rank_values = [] if dp_rank is None else [str(dp_rank)]
        self.labels = [*IDENTITY_LABELS, *self.rank_names]
        self.identity = [model_name, ENGINE_TYPE, *self.rank_values]
        self.up = True
        self.stats: StatsOut | None = None
        self.rates = ReportRates(time.monotonic())
        self.finished: dict[str, int] = {}  # finish_reason -> requests, counted by the front

    def update(self, stats: StatsOut) -> None:
        self.rates.update(stats, time.monotonic())
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield self._gauge("sglang:page_size", "tokens per KV page", self.page_size)
        requests = CounterMetricFamily(
            "kvscope_requests", "requests finished, by finish reason", labels=[*self.rank_names, "reason"]
        )
        for reason, count in sorted(self.finished.items()):
            requests.add_metric([*self.rank_values, reason], count)
        yield requests
        if self.rank_names:
            yield self._plain(GaugeMetricFamily, "kvscope_scheduler_up", "1: the scheduler lives; 0: it died", self.up)
        if stats is None:
            return
        yield from self._pools(stats)
        yield self._gauge("sglang:token_usage", "the fullest pool's used / total tokens", token_usage(stats.pools))
        yield self._gauge(
            "sglang:gen_throughput",
            "tokens generated per second since the previous report",
            self.rates.throughput(time.monotonic()),
        )
        yield self._gauge(
            "sglang:cache_hit_rate",
            "cached / prompt tokens of the requests admitted since the previous report that admitted any",
            self.rates.cache_hit_rate,
        )
        yield self._gauge("sglang:num_running_reqs", "requests running", stats.num_running)
        yield self._gauge("sglang:num_queue_reqs", "requests waiting", stats.num_waiting)
        yield self._plain(GaugeMetricFamily, "kvscope_scheduler_step", "the scheduler's step counter", stats.step)
        for name, doc, value in (
            ("kvscope_retractions", "requests retracted (preempted) for memory", stats.num_retractions),
            ("kvscope_leak_checks_passed", "idle leak checks passed", stats.leak_checks_passed),
            ("kvscope_leak_checks_failed", "idle leak checks failed", stats.leak_checks_failed),
        ):
            yield self._plain(CounterMetricFamily, name, doc, value)

    def _pools(self, stats: StatsOut) -> Iterator[Metric]:
        for pool, each in stats.pools.items():
            prefix = POOL_PREFIX.get(pool)
            if prefix is None:
                continue
            yield self._gauge(
                f"{prefix}_used_tokens",
                f"{pool} pool: total - available - evictable tokens (held by requests)",
                each.used,
            )
            yield self._gauge(f"{prefix}_available_tokens", f"{pool} pool: free tokens", each.available)
            yield self._gauge(
                f"{prefix}_evictable_tokens", f"{pool} pool: cached tokens no request locks", each.evictable
            )
            total_name = "sglang:max_total_num_tokens" + ("" if pool == "full" else f"_{pool}")
            yield self._gauge(total_name, f"{pool} pool: capacity in tokens", each.total)
        protected = GaugeMetricFamily(
            "kvscope_protected_tokens", "cached tokens locked by running requests", labels=[*self.rank_names, "pool"]
        )
        for pool, each in stats.pools.items():
            protected.add_metric([*self.rank_values, pool], each.protected)
        yield protected

    def _plain(
        self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, value: float
    ) -> Metric:
        """A kvscope_* series: no identity labels, the rank's label when there are several."""
        family = kind(name, doc, labels=self.rank_names)
        family.add_metric(self.rank_values, value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self.labels)
        family.add_metric(self.identity, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self.labels)
        family.add_metric(self.identity, value)
        return family


class RanksCollector(Collector):
    """Every rank's series, one family per name (a registry refuses a name collected twice), and the
    server-wide ones: the tokenizer's token totals and the radix cache's evictions, summed over ranks."""

    def __init__(self, ranks: list[SchedulerCollector], model_name: str, cache_kind: str) -> None:
        self.ranks = ranks
        self.identity = [model_name, ENGINE_TYPE]
        self.cache_kind = cache_kind

    def collect(self) -> Iterator[Metric]:
        yield from merge_families(metric for rank in self.ranks for metric in rank.collect())
        reported = [rank.stats for rank in self.ranks if rank.stats is not None]
        if reported:
            yield from self._totals(reported)

    def _totals(self, reported: list[StatsOut]) -> Iterator[Metric]:
        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=IDENTITY_LABELS)
            family.add_metric(self.identity, value)
            return family

        yield counter("sglang:prompt_tokens", "prompt tokens admitted", sum(s.prompt_tokens for s in reported))
        host = [s.host_hit_tokens for s in reported if s.host_hit_tokens is not None]
        cached = CounterMetricFamily(
            "sglang:cached_tokens",
            "prompt tokens the prefix cache matched, by source (SGLang's: device, and host when loaded back)",
            labels=[*IDENTITY_LABELS, "cache_source"],
        )
        cached.add_metric([*self.identity, "device"], sum(s.cached_tokens for s in reported) - sum(host))
        if host:
            cached.add_metric([*self.identity, "host"], sum(host))
        yield cached
        yield counter("sglang:generation_tokens", "tokens generated", sum(s.generated_tokens for s in reported))
        evicted = CounterMetricFamily(
            "sglang:evicted_tokens", "tokens evicted from the prefix cache", labels=CACHE_LABELS
        )
        kind = self.cache_kind
        if kind == AUTO_KIND:  # NOTE: auto is the SWA tree for a hybrid model (it reports an swa pool)
            kind = "swa-radix" if any("swa" in s.pools for s in reported) else "radix"
        evicted.add_metric([SGLANG_CACHE_TYPES.get(kind, kind), "0", "0", "0"], sum(s.evicted_tokens for s in reported))
        yield evicted


def merge_families(metrics: Iterable[Metric]) -> Iterator[Metric]:
    by_name: dict[str, Metric] = {}
    for metric in metrics:
        if metric.name in by_name:
            by_name[metric.name].samples += metric.samples
        else:
            by_name[metric.name] = metric
    return iter(by_name.values())


@dataclass(frozen=True)
class Latencies:
    """The front's latency histograms of one rank."""

    queue_time: Histogram
    ttft: Histogram
    itl: Histogram
    e2e: Histogram


class ServerMetrics:
    """The server's registry: a scheduler collector per rank and the front's histograms."""

    def __init__(self, page_size: int, model_name: str, dp_size: int = 1, cache_kind: str = "radix") -> None:
        self.registry = CollectorRegistry()
        self.ranks = [SchedulerCollector(page_size, model_name, None if dp_size == 1 else r) for r in range(dp_size)]
        self.registry.register(RanksCollector(self.ranks, model_name, cache_kind))
        by_rank = IDENTITY_LABELS if dp_size == 1 else (*IDENTITY_LABELS, RANK_LABEL)

        def histogram(name: str, doc: str, labels: tuple[str, ...] = IDENTITY_LABELS) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        queue_time = histogram("sglang:queue_time_seconds", "arrival to first admission", by_rank)  # the scheduler's
        served = (  # NOTE: the tokenizer's: one series for the server, whatever rank served the request
            histogram("sglang:time_to_first_token_seconds", "arrival to the first generated token"),
            histogram("sglang:inter_token_latency_seconds", "between successive generated tokens"),
            histogram("sglang:e2e_request_latency_seconds", "arrival to the last token"),
        )
        identity = [model_name, ENGINE_TYPE]
        self.latencies = [
            Latencies(queue_time.labels(*rank.identity), *(family.labels(*identity) for family in served))
            for rank in self.ranks
        ]

    def latency(self, rank: int = 0) -> Latencies:
        return self.latencies[rank]

    def update(self, stats: StatsOut, rank: int = 0) -> None:
        self.ranks[rank].update(stats)

    def request_finished(self, reason: str, rank: int = 0) -> None:
        finished = self.ranks[rank].finished
        finished[reason] = finished.get(reason, 0) + 1

    def rank_died(self, rank: int) -> None:
        self.ranks[rank].up = False

    def render(self) -> bytes:
        return generate_latest(self.registry)
