"""--torch-threads: one option of the engine for run and serve. auto is torch's own default for
run; serve on the CPU leaves a core to its HTTP front (torch's threads otherwise fight the front
and its clients for the cores: half the requests/s on two cores)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvscope.app import build_parser, main
from kvscope.app.runner import engine_from_args
from kvscope.engine import Engine, EngineConfig, PoolConfig, model_config

CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def threads_of(argv: list[str], serving: bool) -> int | None:
    engine, _model = engine_from_args(build_parser().parse_args(argv), serving=serving)
    return engine.torch_threads


def test_auto_is_torchs_default_for_run_and_leaves_a_core_for_serve() -> None:
    assert threads_of(["run", "--workload", "random", "--device", "cpu"], serving=False) is None
    assert threads_of(["serve", "--device", "cpu"], serving=True) == max(1, CORES - 1)
    assert threads_of(["serve", "--device", "cpu", "--torch-threads", "auto"], serving=True) == max(1, CORES - 1)


def test_a_given_count_is_taken_as_given() -> None:
    assert threads_of(["run", "--workload", "random", "--torch-threads", "3"], serving=False) == 3
    assert threads_of(["serve", "--device", "cpu", "--torch-threads", "5"], serving=True) == 5


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", ""])
def test_a_bad_count_is_one_line_and_exit_2(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--workload", "random", "--torch-threads", bad])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1] == f"kvscope run: error: argument --torch-threads: {bad!r} is not a thread count "
        "(a whole number >= 1, or auto)"
    )


def test_the_engine_sets_torchs_threads_in_its_process(restore_threads: None) -> None:
    target = 2 if torch.get_num_threads() == 1 else 1
    engine = Engine(
        EngineConfig(pool=PoolConfig(kv_size_tokens=256, max_running_requests=2), device="cpu", torch_threads=target),
        model_config("tiny"),
    )
    assert torch.get_num_threads() == target
    engine.check_integrity()
    untouched = torch.get_num_threads()
    Engine(
        EngineConfig(pool=PoolConfig(kv_size_tokens=256, max_running_requests=2), device="cpu"), model_config("tiny")
    )
    assert torch.get_num_threads() == untouched  # None leaves the process as it was
