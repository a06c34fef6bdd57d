"""Every dashboard page opens a capture shaped like the vLLM probe's (block events with ref-count
kinds, census leak checks, requests with only their finish) without an exception. What each page
shows of it, and says it cannot show, is tests/dashboard/test_capabilities.py's."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.probe import BlockView, census_checks, take_census
from kvscope.telemetry import EventKind, EvictReason, PoolName, PoolTerms, RequestRecord, SQLRecorder, UsageSample
from tests.dashboard.conftest import PAGES, ROOT

FULL = PoolName.FULL


@pytest.fixture(scope="module")
def probe_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("probe") / "probe.db"
    with SQLRecorder(target, config={"source": {"kind": "probe", "engine": "vllm", "version": "0.32.0"}}) as rec:
        for step, rid in enumerate(("r1", "r2"), 1):
            rec.step = step
            if step == 1:
                rec.record(EventKind.INSERT, pool=FULL, rid=rid, node_id=1, num_tokens=32, slots=[1], aux=0)
            rec.record(EventKind.MATCH, pool=FULL, rid=rid, num_tokens=32 * (step - 1), aux=100 - 32 * (step - 1))
            if step == 2:
                rec.record(EventKind.LOCK, pool=FULL, rid=rid, num_tokens=1, slots=[1], aux=0)
                rec.record(EventKind.REVIVE, pool=FULL, rid=rid, num_tokens=1, slots=[1], aux=0)
            rec.record(EventKind.ALLOC, pool=FULL, rid=rid, num_tokens=2, slots=[2 * step, 2 * step + 1], aux=0)
            rec.record(
                EventKind.EVICT, pool=FULL, rid=rid, node_id=2, num_tokens=32, slots=[2], reason=EvictReason.CAPACITY
            )
            rec.record(EventKind.INSERT, pool=FULL, rid=rid, node_id=2 * step, num_tokens=32, slots=[2 * step], aux=1)
            rec.record(EventKind.FREE, pool=FULL, rid=rid, num_tokens=2, slots=[2 * step + 1, 1], aux=0)
            rec.usage(
                UsageSample(
                    step,
                    PoolTerms(352, 352, 0, 0),
                    None,
                    0,
                    0,
                    0,
                    0,
                    100 * step,
                    32 * (step - 1),
                    step,
                    step - 1,
                    0,
                    0,
                    full_used=0,
                )
            )
            done = RequestRecord(rid, None, 100, "finished", 32 * (step - 1), 1)
            done.mark("finish", step, float(step))
            rec.request(done)
            result = take_census(
                BlockView({b: 0 for b in range(1, 12)}, {1}, list(range(1, 12)), 11), [], [], set(), {}
            )
            for check in census_checks(step, result):
                rec.leak_check(check)
    return target


@pytest.mark.parametrize("page", PAGES)
def test_every_page_opens_a_probe_capture(probe_capture: Path, page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_DB", str(probe_capture))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    if page != "overview":
        at.switch_page(f"kvscope/dashboard/app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]


def timeline(at: AppTest) -> dict[str, Any]:
    chart = next(c for c in at.get("plotly_chart") if c.proto.id.endswith("requests.timeline"))
    return dict(json.loads(chart.proto.spec))


def values(raw: Any) -> list[Any]:
    """A trace's array as the browser gets it: a list, or plotly's typed array (base64 bytes)."""
    if isinstance(raw, dict) and "bdata" in raw:
        return list(np.frombuffer(base64.b64decode(raw["bdata"]), dtype=raw["dtype"]))
    return list(raw or [])


def drawn(fig: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Each trace's (request, step) pairs that plotly draws: a bar's start, a marker's step."""
    found: dict[str, list[tuple[str, float]]] = {}
    for trace in fig["data"]:
        at, length = values(trace.get("x")), values(trace.get("x"))
        if trace["type"] == "bar":  # NOTE: a bar from base to base + x; drawn only where both are known
            at = values(trace.get("base"))
        pairs = [
            (str(y), float(x))
            for y, x, n in zip(values(trace.get("y")), at, length, strict=False)
            if x is not None and n is not None and not np.isnan(x) and not np.isnan(n)
        ]
        if pairs:
            found[trace["name"]] = pairs
    return found


def test_the_probe_request_timeline_shows_what_the_probe_recorded(
    probe_capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SGLang probe records a request's finish only: a mark at its finish step. The vLLM probe adds
    its arrival and admission, not its first token: waiting, then one bar from admit to finish."""
    monkeypatch.setenv("KVSCOPE_DB", str(probe_capture))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    at.switch_page("kvscope/dashboard/app_pages/requests.py").run()
    assert drawn(timeline(at)) == {"finished": [("r1", 1.0), ("r2", 2.0)]}
    assert any("records only when each request finished" in c.value for c in at.caption)

    db = tmp_path / "vllm-probe.db"
    with SQLRecorder(db, config={"source": {"kind": "probe", "engine": "vllm", "version": "0.32.0"}}) as rec:
        for rid, arrive, admit, finish in (("a", 1, 2, 5), ("b", 2, 4, 6)):
            done = RequestRecord(rid, None, 64, "finished", 0, 8)
            done.mark("arrive", arrive, float(arrive))
            done.mark("admit", admit, float(admit))
            done.mark("finish", finish, float(finish))
            rec.step = finish
            rec.request(done)
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    at.switch_page("kvscope/dashboard/app_pages/requests.py").run()
    assert not at.exception, [e.value for e in at.exception]
    shown = drawn(timeline(at))
    assert shown == {
        "waiting": [("a", 1.0), ("b", 2.0)],
        "admitted (first token not recorded)": [("a", 2.0), ("b", 4.0)],
    }
    assert any("records no first token" in c.value for c in at.caption)
