"""Orchestration: the only layer that wires the others (tests/test_import_direction.py).

The `kvscope` command (cli.py, a router over commands/, which holds each verb's options) and the
verbs' bodies: `run` (runner.py: RunSpec, the recorder, the debugger's monitor, the engine, the
leak report stored at close, the summary), the capture readers (report.py), the planner (plan.py)
and the pool demo (demo.py); one progress line for all of them (progress.py).

    kvscope.app.main(["run", "--workload", "shared-prefix", "--capture", "run.db"])
    stats = run(RunSpec(engine=EngineConfig(), model=model_config("tiny"), workload="multi-turn"))

NOTE: the runner's names (RunSpec, run, to_engine_requests) load torch: like every name here they are
imported on first use, so `kvscope --help`, the capture readers and the planner never load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.app.cli import build_parser, main
    from kvscope.app.progress import Progress
    from kvscope.app.report import store_leak_report
    from kvscope.app.runner import RunSpec, run, to_engine_requests

# NOTE: every name loads its module on first use: `kvscope instrument` imports kvscope.app.cli and
# its one verb's body, never pandas or SQLAlchemy (its start is the engine's start)
_MODULES = {
    "build_parser": "kvscope.app.cli",
    "main": "kvscope.app.cli",
    "Progress": "kvscope.app.progress",
    "store_leak_report": "kvscope.app.report",
    "RunSpec": "kvscope.app.runner",
    "run": "kvscope.app.runner",
    "to_engine_requests": "kvscope.app.runner",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
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
