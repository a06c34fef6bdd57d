"""The probe: kvscope's recorder and block census inside a real engine's process (vLLM first).

It imports only the standard library, numpy and kvscope.telemetry: it runs in the engine's venv,
which has none of kvscope's other dependencies. Engine modules (vllm.py) are loaded by the
engine's plugin entry points, never from here.
"""

from kvscope.probe.census import TERMS, BlockView, CensusResult, census_checks, take_census
from kvscope.probe.core import PatchResult, ProbeState, Settings, Target, guarded, patch_all, settings_from_env

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
