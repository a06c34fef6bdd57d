"""A real vLLM 0.32 CPU server started under `kvscope instrument` (the probe loaded by vLLM's own
plugin loader in the EngineCore process): a shared-prefix workload in a pool small enough to evict
checks clean, and the probe's lookups agree with vLLM's own /metrics prefix-cache counters.

Run by `make test-engines`; the server start takes minutes here, so one server serves the module.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.telemetry import Capture, EventKind
from tests.engines.test_vllm_attach import complete, counters, prompts
from tests.engines.test_vllm_probe import ROOT, kvscope
from tests.engines.vllm_server import VLLM_PYTHON, VllmServer, vllm_server

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(not Path(VLLM_PYTHON).exists(),
                       reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"),
]


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("probe") / "vllm-probe.db"


@pytest.fixture(scope="module")
def instrumented(capture: Path) -> Iterator[VllmServer]:
    with vllm_server(wrap=(sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--")) as server:
        yield server


def test_an_instrumented_server_checks_clean_and_counts_what_vllm_counts(instrumented: VllmServer,
                                                                        capture: Path) -> None:
    sharing, distinct = prompts()
    for prompt in [*sharing, *distinct]:
        complete(instrumented.url, prompt)
    time.sleep(1.0)  # NOTE: the engine's idle edge comes after the last output is sent
    metrics = counters(instrumented.url)
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        source = json.loads(run.config)["source"]
        assert source["kind"] == "probe" and source["version"] == "0.32.0"
        run_id = int(run.id)
        deadline = time.monotonic() + 30
        while db.leak_checks(run_id).empty and time.monotonic() < deadline:
            time.sleep(0.5)
        matches = db.events(run_id, kinds=[EventKind.MATCH], limit=None)
        assert int(matches.num_tokens.sum()) == metrics["vllm:prefix_cache_hits_total"] == 128
        assert int((matches.num_tokens + matches.aux).sum()) == metrics["vllm:prefix_cache_queries_total"]
        evictions = db.events(run_id, kinds=[EventKind.EVICT], limit=None)
        assert len(evictions) > 0, "the 12-block pool must evict"
        assert db.leak_checks(run_id).ok.astype(bool).all()
    finally:
        db.close()
    check = kvscope("check", str(capture))
    assert check.returncode in (0, 3), check.stdout + check.stderr  # the run is still open while vLLM serves
    assert "leak" not in check.stdout.split(":", 1)[1].split("(")[0], check.stdout


def test_the_server_runs_unharmed_under_the_probe(instrumented: VllmServer) -> None:
    assert counters(instrumented.url)["vllm:num_requests_running"] == 0
    assert ROOT.exists()
