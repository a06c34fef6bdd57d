"""The SGLang probe's census in SGLang's own /metrics (the series: metrics.py).

SGLang's scheduler sets its sglang:* series through prometheus_client in multiprocess mode (the
tokenizer manager's HTTP server reads the scheduler's files at each scrape); SchedulerMetricsCollector
holds the labels it puts on them (model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, dp_rank when
the server has DP ranks, and the operator's extra labels). After each census the probe sets its own
series the same way, with those labels: on the scheduler's thread, values written into prometheus_client's
memory-mapped files (no system call per value once a series exists). Nothing is exported when SGLang's
metrics are off (no collector).

NOTE: differences from vLLM's export (vllm_endpoint.py), where a poll's answer is turned into series
at the scrape
    term label     `POOL.TERM` of each pool's page census (sglang_census.py): full.leaked, full.doubleref,
                   full.locks, full.stale_locked, and the same for swa, req (rows), mamba (slots)
    age            no last_census_age_seconds (nothing runs at the scrape): time() - the timestamp
    up             no kvscope_probe_up (no poll: the series are the scheduler's own)
    recording      a stop sets recording{reason=""} 0 and recording{reason=REASON} 0
prometheus_client comes from SGLang's own venv (an SGLang dependency); it is imported only when the
scheduler has a collector.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from kvscope.probe.metrics import CensusTally, Family, families

PAGE_TERMS = ("leaked", "doubleref", "locks", "stale_locked")
NOT_EXPORTED = ("kvscope_probe_up", "kvscope_probe_last_census_age_seconds")


def page_terms(results: Iterable[Any]) -> dict[str, int]:
    """`POOL.TERM` -> how many pages (rows, slots; locks: tree nodes) each pool's census names."""
    return {f"{r.pool}.{term}": len(getattr(r, term)) for r in results for term in PAGE_TERMS}


class SglangMetrics:
    """The probe's series in one scheduler process, made at its first census with metrics on."""

    def __init__(self) -> None:
        self.series: dict[str, Any] = {}  # NOTE: family name -> its prometheus_client Gauge or Counter
        self.counted: dict[str, float] = {}  # NOTE: a counter's value set so far (prometheus counters only add)

    def publish(self, scheduler: Any, tally: CensusTally, recording: bool, reason: str | None) -> None:
        """The tally as series labelled as the scheduler's own (nothing when its metrics are off)."""
        collector = getattr(scheduler, "metrics_collector", None)
        labels = getattr(collector, "labels", None)
        if not isinstance(labels, dict):
            return
        names = [str(name) for name in labels]
        values = tuple(str(value) for value in labels.values())
        snapshot = tally.snapshot(recording, reason)
        for family in families({values: snapshot}, {values: True}, time.time()):
            if family.name not in NOT_EXPORTED:
                self.set_family(family, names)

    def set_family(self, family: Family, names: list[str]) -> None:
        series = self.series.get(family.name)
        if series is None:
            series = self.series[family.name] = _make(family, names)
        for values, value in family.samples:
            child = series.labels(*values)
            if family.kind == "counter":
                key = f"{family.name}{values}"
                child.inc(max(0.0, value - self.counted.get(key, 0.0)))
                self.counted[key] = value
            else:
                child.set(value)
        if family.name == "kvscope_probe_recording" and family.samples and not family.samples[0][1]:
            stopped_values = family.samples[0][0]
            series.labels(*stopped_values[:-1], "").set(0)  # NOTE: the recording series ("" reason) goes to 0


def _make(family: Family, names: list[str]) -> Any:
    from prometheus_client import Counter, Gauge

    labelnames = [*names, *family.extra]
    if family.kind == "counter":
        return Counter(family.name, family.help, labelnames=labelnames)
    return Gauge(family.name, family.help, labelnames=labelnames, multiprocess_mode="mostrecent")
