"""The test-only fault plugin (tests/engines/faults) on vLLM 0.32's real KVCacheManager and block
pool, without a server and without the probe (tests/engines/faults_driver.py, in the vLLM venv,
seconds): each fault does to the pool exactly what its log line says, so the tests that check the
probe's census against that log check it against the truth. The lingering fault needs vLLM's
Scheduler: tests/engines/test_vllm_soak.py injects it in a real server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.engines.conftest import FAULTS_DIR, ROOT
from tests.engines.vllm_server import VLLM_PYTHON

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    ),
]

DRIVER = Path(__file__).with_name("faults_driver.py")


@pytest.fixture(scope="module")
def driven(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    log = tmp_path_factory.mktemp("faults") / "faults.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{FAULTS_DIR}:{ROOT}", "KVSCOPE_TEST_FAULTS_LOG": str(log)}
    env.pop("KVSCOPE_CAPTURE", None)
    done = subprocess.run(
        [VLLM_PYTHON, str(DRIVER)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_stray_blocks_are_held_by_no_block_table(driven: dict[str, Any]) -> None:
    stray = driven["stray"]
    assert stray["line"]["rid"] == "kvsfault-stray-1" and len(stray["line"]["blocks"]) == 2
    assert stray["refs"] == [1, 1] and stray["in_a_table"] == []


def test_an_unreferenced_hit_is_in_the_table_without_a_reference_until_its_free(driven: dict[str, Any]) -> None:
    noref = driven["noref"]
    blocks = noref["line"]["blocks"]
    assert len(blocks) == 2 and noref["ended"]["blocks"] == blocks
    assert noref["during"]["refs"] == [1, 1]  # NOTE: the holder's reference only
    assert set(blocks) <= set(noref["during"]["table"])
    assert noref["after_hit"] == [1, 1] and noref["after_all"] == [0, 0] and noref["all_free"]


def test_a_double_free_on_preemption_leaves_cached_blocks_queued_at_ref_minus_one(driven: dict[str, Any]) -> None:
    pdfree = driven["pdfree"]
    assert pdfree["line"]["rid"] == "kvsfault-pdfree-1" and len(pdfree["line"]["blocks"]) == 3
    assert pdfree["refs"] == [-1, -1, -1] and pdfree["queued"] == pdfree["line"]["blocks"]
    assert all(pdfree["hashed"])
    assert pdfree["second_refs"] == [0, 0, 0]  # NOTE: once per process: the next preemption frees as vLLM does
