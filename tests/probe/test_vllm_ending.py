"""How the vLLM probe reads the EngineCore's end at its shutdown (vllm.engine_ending), without vLLM:
the exception in flight and the engine's shutdown_state (vLLM 0.32: 0 running, 1 asked, 2 shutting down)."""

from __future__ import annotations

from types import SimpleNamespace

from kvscope.probe.vllm import engine_ending
from kvscope.probe.vllm_hooks import _DRAIN_KINDS


def test_a_normal_shutdown_is_finished_with_a_drain_census() -> None:
    for err in (None, SystemExit(None), SystemExit(0)):
        ending = engine_ending(SimpleNamespace(shutdown_state=2), err)
        assert ending == ("finished", None) and _DRAIN_KINDS[ending.status] == "drain"


def test_an_engine_error_is_crashed_with_its_line_and_a_crash_census() -> None:
    ending = engine_ending(SimpleNamespace(shutdown_state=0), AssertionError("block.ref_cnt == 0"))
    assert ending == ("crashed", "AssertionError: block.ref_cnt == 0") and _DRAIN_KINDS[ending.status] == "crash"


def test_an_error_after_a_shutdown_was_asked_for_is_the_signals_stop_with_no_census() -> None:
    """A killpg's SIGTERM reaches vLLM's workers: the step in flight fails ('RuntimeError: cancelled')."""
    for asked in (1, 2):
        ending = engine_ending(SimpleNamespace(shutdown_state=asked), RuntimeError("cancelled"))
        assert ending.status == "interrupted" and ending.error is not None and "RuntimeError: cancelled" in ending.error
        assert ending.status not in _DRAIN_KINDS
    assert engine_ending(SimpleNamespace(), RuntimeError("cancelled")).status == "crashed"  # NOTE: no state: an error
