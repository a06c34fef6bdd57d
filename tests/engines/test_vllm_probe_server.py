"""A real vLLM 0.32 CPU server started under `kvscope instrument` (the probe loaded by vLLM's own
plugin loader in the EngineCore process): a shared-prefix workload in a pool small enough to evict
checks clean, the probe's lookups agree with vLLM's own /metrics prefix-cache counters, and the run
closes when the server stops.

Run by `make test-engines`; the server start takes minutes here, so the test starts it once.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvscope.telemetry import Capture, EventKind
from tests.engines.test_vllm_attach import complete, counters, prompts
from tests.engines.test_vllm_probe import kvscope
from tests.engines.vllm_server import VLLM_PYTHON, vllm_server

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(not Path(VLLM_PYTHON).exists(),
                       reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"),
]


def wait_for_checks(capture: Path, count: int, timeout_s: float = 30.0) -> None:
    """Until the capture holds `count` census points (the engine's idle edge follows the last output)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        db = Capture(capture)
        try:
            runs = db.runs()
            if not runs.empty and db.leak_checks(int(runs.iloc[-1].id)).step.nunique() >= count:
                return
        finally:
            db.close()
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} census points in {timeout_s} s")


def test_an_instrumented_server_checks_clean_and_counts_what_vllm_counts(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    capture = tmp_path / "vllm-probe.db"
    sharing, distinct = prompts()
    monkeypatch.setenv("VLLM_PLUGINS", "kvscope")  # NOTE: vLLM loads endpoint plugins only when named
    with vllm_server(wrap=(sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--")) as server:
        for prompt in [*sharing, *distinct]:
            complete(server.url, prompt)  # one at a time: each request's end is an idle edge
        metrics = counters(server.url)
        wait_for_checks(capture, len(sharing) + len(distinct))
        live = httpx.get(f"{server.url}/kvscope/census", timeout=30)
    assert live.status_code == 200, live.text
    [engine] = live.json()  # one EngineCore
    assert engine["ok"] and engine["blocks"] == 11 and engine["held"] == 0 and engine["violations"] == []
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        assert int(run.pid) != engine["pid"]  # NOTE: the run's pid is the recorder's host; the config names the engine
        source = json.loads(run.config)["source"]
        assert source["pid"] == engine["pid"]
        assert source["kind"] == "probe" and source["version"] == "0.32.0"
        run_id = int(run.id)
        matches = db.events(run_id, kinds=[EventKind.MATCH], limit=None)
        assert int(matches.num_tokens.sum()) == metrics["vllm:prefix_cache_hits_total"] == 128
        assert int((matches.num_tokens + matches.aux).sum()) == metrics["vllm:prefix_cache_queries_total"] == 900
        assert len(db.events(run_id, kinds=[EventKind.EVICT], limit=None)) > 0, "the 12-block pool must evict"
        assert db.leak_checks(run_id).ok.astype(bool).all()
        assert len(db.requests(run_id)) == 9
    finally:
        db.close()
    check = kvscope("check", str(capture))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "clean: 9 idle leak checks of the vllm 0.32.0 probe's block census held" in check.stdout
