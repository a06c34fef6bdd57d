"""The probe's census as Prometheus series (kvscope/probe/metrics.py, vllm_endpoint.EngineMetrics): the
tally an engine keeps per census, and the text prometheus_client's real registry serves from it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.probe.census import TERMS, BlockView, take_census
from kvscope.probe.metrics import CensusTally
from kvscope.probe.vllm_endpoint import EngineMetrics


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.is_null = block_id, False


def census(ref_counts: dict[int, int], tables: dict[str, list[int]]) -> Any:
    """A real census of a pool: blocks with their ref counts, all but the referenced ones queued."""
    queued = [b for b, ref in ref_counts.items() if ref == 0]
    view = BlockView(ref_counts, set(), queued, len(queued))
    table = {rid: [Block(b) for b in blocks] for rid, blocks in tables.items()}
    return take_census(view, [table], [], set(tables), {})


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_the_tally_counts_each_term_and_the_failed_censuses() -> None:
    tally = CensusTally()
    tally.note(5, census({1: 1, 2: 0, 3: 0}, {"a": [1]}), TERMS)
    tally.note(9, census({1: 1, 2: 1, 3: -1}, {"a": [1]}), TERMS)  # block 2 leaked, block 3 freed twice
    snap = tally.snapshot(True, None)
    assert (snap["censuses"], snap["failed"], snap["last_step"]) == (2, 1, 9)
    assert snap["terms"] == dict.fromkeys(TERMS, 0) | {"leaked": 1, "lostref": 1}


def test_the_tally_counts_the_censuses_of_each_kind() -> None:
    tally = CensusTally()
    for step, kind in enumerate(["busy", "busy", "idle", "busy", "drain"]):
        tally.note(step, census({1: 1}, {"a": [1]}), TERMS, kind)
    tally.note(9, census({1: 1}, {"a": [1]}), TERMS)  # NOTE: no kind given: counted in the total alone
    snap = tally.snapshot(True, None)
    assert snap["censuses"] == 6 and snap["kinds"] == {"busy": 3, "idle": 1, "drain": 1}


def test_a_term_the_census_lacks_is_left_out() -> None:
    tally = CensusTally()
    tally.note(1, census({1: 1}, {"a": [1]}), [*TERMS, "lingered"])
    assert set(tally.snapshot(True, None)["terms"]) == set(TERMS)


def test_the_series_carry_vllms_labels_and_each_census_term() -> None:
    tally = CensusTally()
    tally.note(7, census({1: 1, 2: 1}, {"a": [1]}), TERMS, "busy")
    metrics = EngineMetrics("my-model")
    metrics.take([{**tally.snapshot(True, None), "dp_rank": 1}])
    got = samples(metrics)
    engine = {"model_name": "my-model", "engine": "1"}
    assert got[key("kvscope_probe_leaked_blocks", **engine, term="leaked")] == 1
    assert got[key("kvscope_probe_leaked_blocks", **engine, term="orphans")] == 0
    assert got[key("kvscope_probe_censuses_total", **engine)] == 1
    assert got[key("kvscope_probe_censuses_failed_total", **engine)] == 1
    assert got[key("kvscope_probe_censuses_by_kind_total", **engine, kind="busy")] == 1
    assert got[key("kvscope_probe_last_census_step", **engine)] == 7
    assert 0 <= got[key("kvscope_probe_last_census_age_seconds", **engine)] < 60
    assert abs(got[key("kvscope_probe_last_census_timestamp_seconds", **engine)] - time.time()) < 60
    assert got[key("kvscope_probe_recording", **engine, reason="")] == 1
    assert got[key("kvscope_probe_up", **engine)] == 1


def test_the_census_seconds_sum_each_censuss_engine_thread_time_and_are_absent_until_told() -> None:
    tally = CensusTally()
    metrics = EngineMetrics("m")
    metrics.take([{**tally.snapshot(True, None), "dp_rank": 0}])
    assert not [name for name, _ in samples(metrics) if name.startswith("kvscope_probe_census_seconds")]
    tally.spent(0.25)
    tally.spent(0.5)
    metrics.take([{**tally.snapshot(True, None), "dp_rank": 0}])
    assert samples(metrics)[key("kvscope_probe_census_seconds_total", model_name="m", engine="0")] == 0.75


def test_a_stopped_recording_reads_0_with_its_reason_and_no_census_yet_has_no_census_series() -> None:
    metrics = EngineMetrics("m")
    metrics.take([{**CensusTally().snapshot(False, "the recorder's host process ended"), "dp_rank": 0}])
    got = samples(metrics)
    reason = "the recorder's host process ended"
    assert got[key("kvscope_probe_recording", model_name="m", engine="0", reason=reason)] == 0
    assert not [key for key in got if key[0] in ("kvscope_probe_last_census_step", "kvscope_probe_leaked_blocks")]


class SilentEngine:
    """An engine client whose utility calls never answer (a hung or dead engine)."""

    async def call_utility_all_async(self, method: str) -> list[Any]:
        await asyncio.sleep(3600)
        return []


def test_an_engine_that_does_not_answer_reads_down_and_keeps_its_last_values(monkeypatch: Any) -> None:
    import kvscope.probe.vllm_endpoint as endpoint

    monkeypatch.setattr(endpoint, "POLL_TIMEOUT_S", 0.05)
    monkeypatch.setattr(endpoint, "POLL_INTERVAL_S", 0.01)
    metrics = EngineMetrics("m")
    metrics.take([{**CensusTally().snapshot(True, None), "dp_rank": 0}])

    async def poll_briefly() -> None:
        task = asyncio.get_running_loop().create_task(metrics.poll(SilentEngine()))
        await asyncio.sleep(0.2)  # NOTE: the loop stays free meanwhile: this sleep ends on time
        task.cancel()

    asyncio.run(poll_briefly())
    got = samples(metrics)
    assert got[key("kvscope_probe_up", model_name="m", engine="0")] == 0
    assert got[key("kvscope_probe_censuses_total", model_name="m", engine="0")] == 0


class RefusingEngine:
    """An engine without kvscope_metrics (the probe refused its version): vLLM answers each call with a failure."""

    def __init__(self) -> None:
        self.calls = 0

    async def call_utility_all_async(self, method: str) -> list[Any]:
        self.calls += 1
        raise RuntimeError(f"Call to {method} method failed: 'EngineCoreProc' object has no attribute {method!r}")


def test_an_engine_that_fails_the_call_is_asked_no_more_and_reads_down(monkeypatch: Any) -> None:
    import kvscope.probe.vllm_endpoint as endpoint

    monkeypatch.setattr(endpoint, "POLL_INTERVAL_S", 0.01)
    metrics, engine = EngineMetrics("m"), RefusingEngine()

    async def poll_briefly() -> bool:
        task = asyncio.get_running_loop().create_task(metrics.poll(engine))
        await asyncio.sleep(0.2)
        done = task.done()
        task.cancel()
        return done

    assert asyncio.run(poll_briefly())
    assert engine.calls == 1
    assert samples(metrics)[key("kvscope_probe_up", model_name="m", engine="0")] == 0
