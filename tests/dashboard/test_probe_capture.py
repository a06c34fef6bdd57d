"""Every dashboard page opens a capture shaped like the vLLM probe's (block events with ref-count
kinds, census leak checks, requests with only their finish) without an exception. What each page
shows of it, and says it cannot show, is tests/dashboard/test_capabilities.py's."""

from __future__ import annotations

from pathlib import Path

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
