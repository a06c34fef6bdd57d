"""The kvscope_probe_* series with vLLM's --api-server-count > 1: every API server process serves them on its
own /metrics, with the engines' values, beside vLLM's multiprocess series (kvscope/probe/vllm_endpoint.py).

Two API server processes of vllm_metrics_driver.py (vLLM 0.32's own build_app and endpoint plugins, the real
prometheus_client MultiProcessCollector over one PROMETHEUS_MULTIPROC_DIR; an engine client stands in for
the engines, answering a real census tally), no server start: under two minutes here.
Run by `make test-engines`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.engines.conftest import ROOT
from tests.engines.vllm_server import VLLM_PYTHON

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    ),
]
DRIVER = Path(__file__).with_name("vllm_metrics_driver.py")
API_SERVERS = 2


def scrapes(tmp_path: Path) -> list[list[dict[str, Any]]]:
    """What each API server's /metrics served (kvscope_probe_* and the API servers' own counter)."""
    folder = tmp_path / "prometheus"
    folder.mkdir()
    env = {
        "PYTHONPATH": str(ROOT),
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
        "VLLM_PLUGINS": "kvscope",
        "KVSCOPE_CAPTURE": str(tmp_path / "unused.db"),  # NOTE: the probe's switch; no engine here writes it
    }
    servers = [
        subprocess.Popen(
            [VLLM_PYTHON, str(DRIVER), str(i), str(API_SERVERS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            cwd=tmp_path,
        )
        for i in range(API_SERVERS)
    ]
    answers = []
    for server in servers:
        out, err = server.communicate(timeout=600)
        assert server.returncode == 0, err[-3000:]
        answers.append(json.loads(out.strip().splitlines()[-1]))
    return answers


def value(samples: list[dict[str, Any]], name: str, **labels: str) -> float | None:
    found = [s["value"] for s in samples if s["name"] == name and labels.items() <= s["labels"].items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def test_every_api_server_serves_the_probes_series_with_the_engines_values(tmp_path: Path) -> None:
    for samples in scrapes(tmp_path):
        engine = {"model_name": "soak-model", "engine": "0"}
        # NOTE: vLLM's multiprocess series are still served: every API server's counter, summed (1 + 2)
        assert value(samples, "vllm:kvscope_test_api_server_requests_total") == 3, samples
        assert value(samples, "kvscope_probe_leaked_blocks", **engine, term="leaked") == 1, samples
        assert value(samples, "kvscope_probe_leaked_blocks", **engine, term="lostref") == 0
        assert value(samples, "kvscope_probe_censuses_total", **engine) == 2
        assert value(samples, "kvscope_probe_censuses_failed_total", **engine) == 1
        assert value(samples, "kvscope_probe_censuses_by_kind_total", **engine, kind="busy") == 2
        assert value(samples, "kvscope_probe_last_census_step", **engine) == 9
        age = value(samples, "kvscope_probe_last_census_age_seconds", **engine)
        assert age is not None and 0 <= age < 600, age
        assert value(samples, "kvscope_probe_recording", **engine, reason="") == 1
        assert value(samples, "kvscope_probe_up", **engine) == 1
