"""The engine: a tiny model and the scheduler that drives it over the memory system.

    engine = Engine(EngineConfig(), model_config("tiny"), recorder, read_checker=checker)
    stats = engine.run(requests, progress=hook)   # hook(stats, num_submitted) after each step

It takes any `Recorder` (kvscope.telemetry) and an optional `ReadChecker`, and imports
neither the debugger nor the SQL store: the app layer wires those in.

NOTE: the configs load no torch; every other name loads the engine (and torch) on first use,
so a caller that only declares options (the `kvscope` parser) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvscope.engine.cache_kinds import (
    AUTO,
    CACHE_KINDS,
    CacheKind,
    CacheKindSpec,
    auto_cache_kind,
    cache_kind,
    cli_help,
    either,
    kinds_with,
)
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig

if TYPE_CHECKING:
    from kvscope.engine.engine import Engine, ProgressHook, check_faults, check_request
    from kvscope.engine.faults import FaultSpec
    from kvscope.engine.model import MODEL_PRESETS, ModelConfig, model_config
    from kvscope.engine.read_check import ReadChecker
    from kvscope.engine.request import Req
    from kvscope.engine.scheduler import LogitsHook
    from kvscope.engine.stats import EngineStalled, EngineStats, LeakDetected

_LAZY_NAMES = {
    "Engine": "kvscope.engine.engine",
    "ProgressHook": "kvscope.engine.engine",
    "check_faults": "kvscope.engine.engine",
    "check_request": "kvscope.engine.engine",
    "FaultSpec": "kvscope.engine.faults",
    "MODEL_PRESETS": "kvscope.engine.model",
    "ModelConfig": "kvscope.engine.model",
    "model_config": "kvscope.engine.model",
    "ReadChecker": "kvscope.engine.read_check",
    "Req": "kvscope.engine.request",
    "LogitsHook": "kvscope.engine.scheduler",
    "EngineStalled": "kvscope.engine.stats",
    "EngineStats": "kvscope.engine.stats",
    "LeakDetected": "kvscope.engine.stats",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'kvscope.engine' has no attribute {name!r}")


__all__ = [
    "AUTO",
    "CACHE_KINDS",
    "MODEL_PRESETS",
    "CacheConfig",
    "CacheKind",
    "CacheKindSpec",
    "Engine",
    "EngineConfig",
    "EngineStalled",
    "EngineStats",
    "FaultSpec",
    "LeakDetected",
    "LogitsHook",
    "ModelConfig",
    "PoolConfig",
    "ProgressHook",
    "ReadChecker",
    "Req",
    "SchedulerConfig",
    "auto_cache_kind",
    "cache_kind",
    "check_faults",
    "check_request",
    "cli_help",
    "either",
    "kinds_with",
    "model_config",
]
