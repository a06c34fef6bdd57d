"""The probe's engine-neutral core without an engine: the census terms on a hand-built pool, the
all-or-nothing patcher, the guard that keeps kvscope's exceptions out of the engine, activation."""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest

from kvscope.probe import (
    TERMS,
    BlockView,
    ProbeState,
    Target,
    census_checks,
    guarded,
    patch_all,
    settings_from_env,
    take_census,
)
from kvscope.probe.core import (
    LAST_CENSUS,
    Settings,
    busy_census_due,
    census_clock,
    engine_ending,
    error_line,
    run_label,
    unpatch_all,
)


class Block(NamedTuple):
    """What the census reads of an engine's block in a block table."""

    block_id: int
    is_null: bool = False


def census(
    refs: dict[int, int],
    queued: list[int],
    tables: dict[str, list[int]],
    live: set[str],
    counter: int | None = None,
    deferred: list[list[int]] | None = None,
) -> Any:
    return take_census(
        BlockView(refs, {1, 2}, queued, len(queued) if counter is None else counter),
        [{rid: [Block(b) for b in blocks] for rid, blocks in tables.items()}],
        [[Block(b) for b in blocks] for blocks in deferred or []],
        live,
        {3: ("req-x", 7, "alloc")},
    )


def test_a_consistent_pool_holds_every_term() -> None:
    result = census({1: 1, 2: 0, 3: 2, 4: 0}, [2, 4], {"a": [1, 3], "b": [3]}, {"a", "b"})
    assert result.ok
    assert [c.ok for c in census_checks(5, result)] == [True] * len(TERMS)
    assert [c.pool for c in census_checks(5, result)] == list(TERMS)


def test_deferred_frees_count_as_references() -> None:
    assert census({1: 1, 2: 0}, [2], {}, set(), deferred=[[1]]).ok


@pytest.mark.parametrize(
    ("refs", "queued", "tables", "live", "counter", "term", "text"),
    [
        (
            {1: 1, 3: 1},
            [],
            {"a": [1]},
            {"a"},
            None,
            "leaked",
            "1 block leaked: block 3 ref 1, accounted 0; last taken by request req-x (alloc at step 7)",
        ),
        (
            {1: 0, 3: 0},
            [1, 3],
            {"a": [1]},
            {"a"},
            None,
            "lostref",
            "1 block released too often or hit without a reference: block 1 ref 0, accounted 1; culprit unknown",
        ),
        ({1: 0, 3: 0}, [1], {}, set(), None, "unqueued", "1 block with ref 0 missing from the free queue: 3"),
        ({1: 1, 3: 0}, [1, 3], {"a": [1]}, {"a"}, None, "qheld", "1 block referenced and in the free queue: 1"),
        ({1: 0}, [1], {}, set(), 2, "qcount", "the free queue's counter is +1 off its list's length"),
        ({1: 1}, [], {"gone": [1]}, set(), None, "orphans", "1 block tables of requests that no longer exist: gone"),
    ],
)
def test_each_term_names_what_breaks_it(
    refs: dict[int, int],
    queued: list[int],
    tables: dict[str, list[int]],
    live: set[str],
    counter: int | None,
    term: str,
    text: str,
) -> None:
    checks = {c.pool: c for c in census_checks(9, census(refs, queued, tables, live, counter))}
    assert not checks[term].ok and text in checks[term].message(), checks[term].message()
    assert [t for t, c in checks.items() if not c.ok] == [term]


@pytest.fixture
def engine_module() -> Iterator[types.ModuleType]:
    """A stand-in for an engine module with one class to patch."""
    module = types.ModuleType("fake_engine_for_probe")

    class Pool:
        def take(self, n: int) -> list[int]:
            return list(range(n))

        def give(self, blocks: list[int]) -> int:
            return len(blocks)

    module.Pool = Pool  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _counting(calls: list[str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any) -> Any:
            calls.append(original.__name__)
            return original(self, *args)

        return wrapper

    return factory


def test_every_target_is_patched_or_none_is(engine_module: types.ModuleType) -> None:
    calls: list[str] = []
    name = engine_module.__name__
    targets = [
        Target(name, "Pool", "take", _counting(calls)),
        Target(name, "Pool", "give", _counting(calls)),
        Target(name, "Pool", "gone", _counting(calls)),
        Target("no_such_engine_module", "X", "y", _counting(calls)),
    ]
    result = patch_all(targets)
    assert result.patched == [] and result.missing == [f"{name}.Pool.gone", "no_such_engine_module.X.y"]
    pool = engine_module.Pool()
    assert pool.take(2) == [0, 1] and calls == []  # take exists, but was not patched either
    result = patch_all(targets[:2])
    assert result.patched == ["Pool.take", "Pool.give"] and not result.missing
    assert pool.take(2) == [0, 1] and pool.give([5]) == 1 and calls == ["take", "give"]
    unpatch_all(targets[:2])
    assert pool.take(1) == [0] and calls == ["take", "give"]


def test_an_exception_in_kvscopes_part_stops_recording_and_never_reaches_the_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = ProbeState(active=True)
    with guarded(state):
        raise OSError("No space left on device")
    with guarded(state):
        raise RuntimeError("a second one is not reported again")
    assert not state.active and state.reason == "OSError: No space left on device"
    assert capsys.readouterr().err == "kvscope probe: recording stopped: OSError: No space left on device\n"


def test_the_probes_state_says_whether_it_records_and_why_not() -> None:
    """Both probes' /metrics read it (kvscope_probe_recording and its reason): a stopped probe says its
    reason; an active one whose recorder failed says the recorder's failure."""

    class Failing:
        failure = "disk full"

    assert ProbeState(active=True).recording() == (True, None)
    assert ProbeState(active=False, reason="refused").recording() == (False, "refused")
    assert ProbeState(recorder=Failing(), active=True).recording() == (False, "disk full")  # type: ignore[arg-type]
    assert ProbeState(recorder=Failing(), reason="stopped").recording() == (False, "stopped")  # type: ignore[arg-type]


def test_a_runs_label_names_the_engine_version_rank_and_process() -> None:
    assert run_label("vllm", "0.32.0", 42, 1) == "vllm 0.32.0 probe dp 1 pid 42"
    assert run_label("sglang", "0.5.23", 7) == "sglang 0.5.23 probe pid 7"
    assert run_label("sglang", "0.5.23", 7, 0) == "sglang 0.5.23 probe dp 0 pid 7"
    assert error_line(ValueError("first\nsecond")) == "ValueError: first"


def test_the_probe_is_inert_without_a_capture() -> None:
    assert settings_from_env({}, engine="vllm") is None
    assert settings_from_env({"KVSCOPE_CAPTURE": "  "}, engine="vllm") is None
    settings = settings_from_env({"KVSCOPE_CAPTURE": "/tmp/x.db", "KVSCOPE_PYTHON": "/usr/bin/python3"}, engine="vllm")
    assert settings is not None and settings.level == "full" and settings.python == "/usr/bin/python3"


@pytest.mark.parametrize(("engine", "level"), [("vllm", "full"), ("sglang", "summary")])
def test_without_kvscope_level_each_engine_takes_the_level_within_its_cost_target(engine: str, level: str) -> None:
    """DEFAULT_LEVEL: full on vLLM (under 1 µs per block-pool call), summary on SGLang (its full costs
    2-3 µs per allocator or tree call); KVSCOPE_LEVEL names either on both."""
    base = {"KVSCOPE_CAPTURE": "/tmp/x.db"}
    assert settings_from_env(base, engine=engine).level == level  # type: ignore[union-attr]
    assert settings_from_env({**base, "KVSCOPE_LEVEL": " "}, engine=engine).level == level  # type: ignore[union-attr]
    for named in ("summary", "full"):
        assert settings_from_env({**base, "KVSCOPE_LEVEL": named}, engine=engine).level == named  # type: ignore[union-attr]


def test_a_forked_child_does_not_write_into_its_parents_recorder() -> None:
    """The vLLM probe's hot wrappers trust a flag instead of os.getpid() per call: a fork resets it,
    so the child opens a recorder of its own instead of extending its parent's buffer."""
    from kvscope.probe import vllm as probe

    buffer: list[object] = []
    saved = probe.PROBE.hot, probe.PROBE.emit
    probe.PROBE.hot, probe.PROBE.emit = True, buffer.extend
    try:
        pid = os.fork()
        if pid == 0:  # NOTE: the child reports through its exit status only
            os._exit(0 if (probe.PROBE.hot, probe.PROBE.emit) == (False, None) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert probe.PROBE.hot and probe.PROBE.emit == buffer.extend  # NOTE: the parent keeps its own
    finally:
        probe.PROBE.hot, probe.PROBE.emit = saved


def test_the_census_and_lingering_bounds_come_from_the_environment() -> None:
    base = {"KVSCOPE_CAPTURE": "/tmp/x.db"}
    defaults = settings_from_env(base, engine="vllm")
    assert defaults is not None and defaults.census_every_steps > 0 and defaults.census_every_s > 0
    assert defaults.linger_steps > 0 and defaults.linger_s > 0
    given = settings_from_env(
        {
            **base,
            "KVSCOPE_CENSUS_EVERY_STEPS": "7",
            "KVSCOPE_CENSUS_EVERY_S": "0",
            "KVSCOPE_LINGER_STEPS": "3",
            "KVSCOPE_LINGER_S": "1.5",
        },
        engine="vllm",
    )
    assert given is not None and given[3:7] == (7, 0.0, 3, 1.5)


def test_the_retention_bounds_come_from_the_environment() -> None:
    base = {"KVSCOPE_CAPTURE": "/tmp/x.db"}
    defaults = settings_from_env(base, engine="vllm")
    assert defaults is not None and (defaults.keep_events_s, defaults.max_bytes) == (None, 4 * 2**30)
    given = settings_from_env({**base, "KVSCOPE_KEEP_EVENTS": "6h", "KVSCOPE_MAX_SIZE": "none"}, engine="vllm")
    assert given is not None and (given.keep_events_s, given.max_bytes) == (21600.0, None)
    with pytest.raises(ValueError, match="KVSCOPE_MAX_SIZE: '20 apples' is not a size"):
        settings_from_env({**base, "KVSCOPE_MAX_SIZE": "20 apples"}, engine="vllm")


@pytest.mark.parametrize(
    ("name", "value"),
    [("KVSCOPE_CENSUS_EVERY_STEPS", "1.5"), ("KVSCOPE_LINGER_S", "-1"), ("KVSCOPE_CENSUS_EVERY_S", "soon")],
)
def test_a_bound_that_is_not_a_number_at_least_zero_is_refused_by_name(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be .* >= 0, got '{value}'"):
        settings_from_env({"KVSCOPE_CAPTURE": "/tmp/x.db", name: value}, engine="vllm")


def test_a_busy_census_is_due_after_either_bound_and_never_within_its_cost_budget() -> None:
    every = Settings("/tmp/x.db", "full", None, census_every_steps=10, census_every_s=5.0)
    assert not busy_census_due(every, 9, 4.9, 0.0)
    assert busy_census_due(every, 10, 0.5, 0.0) and busy_census_due(every, 1, 5.0, 0.0)
    assert not busy_census_due(every, 10, 0.5, 0.01)  # NOTE: 0.5 s < 100 x the last census's 10 ms
    assert busy_census_due(every, 10, 1.0, 0.01)
    off = every._replace(census_every_steps=0, census_every_s=0.0)
    assert not busy_census_due(off, 10**6, 10.0**6, 0.0) and not busy_census_due(None, 10, 10.0, 0.0)


def test_a_census_that_waits_costs_its_cpu_not_its_wait() -> None:
    """A census descheduled on a loaded machine (here: asleep) must not put the next one off by 100x
    the wait: its cost is read on the engine thread's CPU clock."""
    every = Settings("/tmp/x.db", "full", None, census_every_steps=10, census_every_s=5.0)
    started = census_clock()
    time.sleep(0.3)
    cost_s = census_clock() - started
    assert cost_s < 0.05
    assert busy_census_due(every, 10, 5.0, cost_s)


def test_how_an_engines_loop_ended_gives_its_runs_status_and_last_census() -> None:
    assert engine_ending(None, shutdown_asked=True) == ("finished", None) and LAST_CENSUS["finished"] == "drain"
    crashed = engine_ending(AssertionError("leak"), shutdown_asked=False)
    assert crashed == ("crashed", "AssertionError: leak") and LAST_CENSUS["crashed"] == "crash"
    stopped = engine_ending(RuntimeError("cancelled"), shutdown_asked=True)
    assert stopped == ("interrupted", "a shutdown was asked for while a step ran: RuntimeError: cancelled")
    assert "interrupted" not in LAST_CENSUS
    assert engine_ending(KeyboardInterrupt(), shutdown_asked=False) == ("interrupted", "KeyboardInterrupt")
    assert engine_ending(SystemExit(0), shutdown_asked=True) == ("finished", None)
