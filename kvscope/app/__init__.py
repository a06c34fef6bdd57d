"""Orchestration: the only layer that wires the others (tests/test_import_direction.py).

The `kvscope` command (cli.py, a router over commands/, which holds each verb's options) and the
verbs' bodies: `run` (runner.py: RunSpec, the recorder, the debugger's monitor, the engine, the
leak report stored at close, the summary), the capture readers (report.py), the planner (plan.py)
and the pool demo (demo.py); one progress line for all of them (progress.py).

    kvscope.app.main(["run", "--workload", "shared-prefix", "--capture", "run.db"])
    stats = run(RunSpec(engine=EngineConfig(), model=model_config("tiny"), workload="multi-turn"))

NOTE: the runner's names (RunSpec, run, to_engine_requests) load torch: they are imported on
first use, so `kvscope --help`, the capture readers and the planner never load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvscope.app.cli import build_parser, main
from kvscope.app.progress import Progress
from kvscope.app.report import store_leak_report

if TYPE_CHECKING:
    from kvscope.app.runner import RunSpec, run, to_engine_requests

_RUNNER_NAMES = ("RunSpec", "run", "to_engine_requests")


def __getattr__(name: str) -> Any:
    if name in _RUNNER_NAMES:
        import importlib

        return getattr(importlib.import_module("kvscope.app.runner"), name)
    raise AttributeError(f"module 'kvscope.app' has no attribute {name!r}")


__all__ = [
    "Progress",
    "RunSpec",
    "build_parser",
    "main",
    "run",
    "store_leak_report",
    "to_engine_requests",
]
