"""The probe: kvscope's recorder and block census inside a real engine's process (vLLM first).

It imports only the standard library, numpy and kvscope.telemetry: it runs in the engine's venv,
which has none of kvscope's other dependencies. Engine modules (vllm.py) are loaded by the
engine's plugin entry points, never from here.
"""

from typing import Any

from kvscope.probe.core import PatchResult, ProbeState, Settings, Target, guarded, patch_all, settings_from_env

_CENSUS = ("TERMS", "BlockView", "CensusResult", "census_checks", "take_census")


def __getattr__(name: str) -> Any:
    """The census's names, loaded on first use (it needs numpy): `kvscope instrument` checks the
    probe's settings with the core alone before it execs the engine."""
    if name in _CENSUS:
        from kvscope.probe import census

        return getattr(census, name)
    raise AttributeError(f"module 'kvscope.probe' has no attribute {name!r}")


__all__ = [
    "TERMS",
    "BlockView",
    "CensusResult",
    "PatchResult",
    "ProbeState",
    "Settings",
    "Target",
    "census_checks",
    "guarded",
    "patch_all",
    "settings_from_env",
    "take_census",
]
