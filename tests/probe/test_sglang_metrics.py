"""The SGLang probe's series (kvscope/probe/sglang_metrics.py) as SGLang serves its own: prometheus_client
in multiprocess mode, written by the scheduler process, read by a MultiProcessCollector in another.
The scheduler's labels are SGLang 0.5.23's SchedulerMetricsCollector.labels (its keys, with a DP rank).

NOTE: not on SGLang's real collector: the SGLang venv make test-engines builds has no prometheus_client
(SGLang's own metrics are off there); the labels' shape is SGLang's (metrics_collector.py, init_new)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
LABELS = {
    "model_name": "m",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
    "dp_rank": "1",
}

# NOTE: the scheduler process: three censuses of a real page census (sglang_census.take_page_census), two
# busy and the drain, the last two naming a leaked page; then recording stops and is published once more
SCHEDULER = f"""
import sys
from types import SimpleNamespace
from kvscope.probe.metrics import CensusTally
from kvscope.probe.sglang_census import PageView, take_page_census
from kvscope.probe.sglang_metrics import SglangMetrics, page_terms

scheduler = SimpleNamespace(metrics_collector=SimpleNamespace(labels={LABELS!r}))
tally, metrics = CensusTally(), SglangMetrics()
clean = take_page_census("full", PageView(1, 4, [1, 2, 3, 4], set(), {{}}), {{}}, {{}}, {{}})
leak = take_page_census("full", PageView(1, 4, [1, 2, 3], set(), {{}}), {{}}, {{}}, {{}})
for step, result, kind in ((3, clean, "busy"), (8, leak, "busy"), (9, leak, "drain")):
    tally.note_counts(step, page_terms([result]), kind)
    metrics.publish(scheduler, tally, True, None)
if sys.argv[1] == "stop":
    metrics.publish(scheduler, tally, False, "the recorder's host process ended")
"""

READER = """
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def scrape(tmp_path: Path, mode: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    env = {"PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for script, args in ((SCHEDULER, [mode]), (READER, [])):
        out = subprocess.run(
            [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert out.returncode == 0, out.stderr
    return _grouped(out.stdout)


def _grouped(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvscope_probe_"):
                found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def test_the_series_carry_sglangs_scheduler_labels_and_each_pools_terms(tmp_path: Path) -> None:
    got = scrape(tmp_path, "run")
    leaked = {labels["term"]: value for labels, value in got["kvscope_probe_leaked_blocks"]}
    assert leaked == {"full.leaked": 1, "full.doubleref": 0, "full.locks": 0, "full.stale_locked": 0}
    for labels, _ in got["kvscope_probe_leaked_blocks"]:
        assert {k: v for k, v in labels.items() if k != "term"} == LABELS
    assert got["kvscope_probe_censuses_total"] == [(LABELS, 3.0)]
    assert got["kvscope_probe_censuses_failed_total"] == [(LABELS, 2.0)]
    by_kind = sorted(
        (labels.pop("kind"), labels, value) for labels, value in got["kvscope_probe_censuses_by_kind_total"]
    )
    assert by_kind == [("busy", LABELS, 2.0), ("drain", LABELS, 1.0)]
    assert got["kvscope_probe_last_census_step"] == [(LABELS, 9.0)]
    assert got["kvscope_probe_recording"] == [({**LABELS, "reason": ""}, 1.0)]
    assert "kvscope_probe_up" not in got and "kvscope_probe_last_census_timestamp_seconds" in got


def test_a_stop_reads_0_with_its_reason(tmp_path: Path) -> None:
    got = scrape(tmp_path, "stop")
    recording = sorted((labels["reason"], value) for labels, value in got["kvscope_probe_recording"])
    assert recording == [("", 0.0), ("the recorder's host process ended", 0.0)], json.dumps(recording)
