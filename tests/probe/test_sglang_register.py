"""The SGLang probe's registration by level, without SGLang (the engine tests register it on SGLang's
real classes): level summary asks only for the per-batch, per-request and idle targets; a level that
is neither refuses in one line and patches nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvscope.probe import sglang as probe


@pytest.fixture(autouse=True)
def _no_refusal_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("KVSCOPE_CAPTURE", str(tmp_path / "never.db"))
    monkeypatch.setenv("KVSCOPE_PROBE_REFUSED", "1")  # NOTE: as in an engine's later process: no refusal run
    yield
    probe.PROBE.__init__(None, "")  # type: ignore[misc]


def _hook(original: Any, *args: Any, **kwargs: Any) -> Any:
    return original(*args, **kwargs)


TABLE = {
    "0.5.23": lambda: [
        probe.Hook("kvscope_nowhere.Pool.alloc", _hook, direct=True, per_op=True),
        probe.Hook("kvscope_nowhere.Batch.prepare_for_decode", _hook),
    ]
}


@pytest.mark.parametrize(("level", "missing"), [("full", "Pool.alloc, kvscope_nowhere.Batch"), ("summary", "Batch")])
def test_level_summary_needs_only_the_targets_it_hooks(
    monkeypatch: pytest.MonkeyPatch, level: str, missing: str
) -> None:
    monkeypatch.setenv("KVSCOPE_LEVEL", level)
    said = probe._register("0.5.23", TABLE)
    assert said.startswith(f"SGLang 0.5.23: kvscope_nowhere.{missing}.") and said.endswith("; nothing patched")
    assert not probe.PROBE.state.active


def test_a_level_that_is_neither_refuses_and_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSCOPE_LEVEL", "verbose")
    said = probe._register("0.5.23", TABLE)
    assert said == "KVSCOPE_LEVEL must be summary or full, got 'verbose'; nothing patched"
    assert not probe.PROBE.state.active and capsys.readouterr().err.count("\n") == 1


def test_at_level_summary_the_allocators_and_trees_stay_sglangs() -> None:
    """Every hook on an allocator or tree operation (each direct patch, the HiCache component's) is
    full-only; summary keeps the batch, request, row and idle hooks."""
    kept = {h.target.rsplit(".", 2)[-2] + "." + h.target.rsplit(".", 1)[-1] for h in probe.hooks() if not h.per_op}
    assert kept == {
        "SWATokenToKVPoolAllocator.__init__",
        "ReqToTokenPool.alloc",
        "ReqToTokenPool.free_rows",
        "ScheduleBatch.prepare_for_extend",
        "ScheduleBatch.prepare_for_decode",
        "ScheduleBatch.retract_decode",
        "common.release_kv_cache",
        "Scheduler.on_idle",
        "Scheduler.event_loop_normal",
        "Scheduler.event_loop_overlap",
        "Scheduler.ingest_requests",
        "Scheduler.run_event_loop",
        "SchedulerInvariantChecker._report_leak",
        "SchedulerInvariantChecker._check_req_pool",
    }
    assert all(h.per_op for h in probe.hooks() if h.direct)
