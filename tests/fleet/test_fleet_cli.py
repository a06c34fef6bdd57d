"""`kvscope fleet`: the table, --json, a capture with no fleet, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.app import main
from tests.fleet.fleet_capture import write_fleet


@pytest.fixture(scope="module")
def fleet_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fleet") / "fleet.db"
    write_fleet(path)
    return path


def test_fleet_json_carries_the_figures(fleet_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", str(fleet_db), "--fleet", "f1", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["fleet"] == {"id": "f1", "source": "kvscope", "size": 2, "replicas": 2}
    assert [r["idle_floor_tokens"] for r in found["replicas"]] == [4, 10]
    assert {r["dispatch"]: r["loss_tokens"] for r in found["routing"]} == {"prefix_affinity": 0, "round_robin": 8}
    dup = found["duplication"]
    assert (dup["held_tokens"], dup["unique_tokens"], dup["duplicated_tokens"]) == (12, 8, 4)
    assert found["other_fleets"] == ["old"] and found["notes"] == []
    assert found["runs_in_no_fleet"] == [4]


def test_fleet_table_names_the_fleet_and_its_notes(fleet_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", str(fleet_db)]) == 0  # the latest fleet: "old", with no page hashes
    out = capsys.readouterr().out
    assert out.startswith("fleet old (kvscope): 1 replicas of 1")
    assert "duplication: not known" in out and "other fleets in this capture: f1" in out
    assert out.splitlines()[-1] == "runs in no fleet: 4 (kvscope check CAPTURE --run ID)"


def test_a_capture_without_a_fleet_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvscope.telemetry import SQLRecorder

    path = tmp_path / "one.db"
    with SQLRecorder(path):
        pass
    assert main(["fleet", str(path)]) == 1
    assert (
        capsys.readouterr().out.strip()
        == f"{path}: no fleet (no run carries fleet keys or a vLLM data-parallel rank); runs: 1"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.db"], "no such file"),
        (["FLEET", "--fleet", "nope"], "no fleet 'nope' in this capture"),
    ],
)
def test_bad_input_is_one_line(
    fleet_db: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [str(fleet_db) if a == "FLEET" else str(tmp_path / a) if a.endswith(".db") else a for a in argv]
    assert main(["fleet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvscope fleet: error: ") and message in err


def run_verdict(fleet_db: Path, run_id: int, capsys: pytest.CaptureFixture[str]) -> int:
    code = main(["check", str(fleet_db), "--run", str(run_id)])
    capsys.readouterr()
    return code


def test_check_fleet_gives_each_replicas_verdict_and_the_worst_as_exit(
    fleet_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """f1: rank 0's idle check is balanced, rank 1 holds 2 tokens at idle (a leak): the fleet exits 1
    whatever order the ranks come in, and each rank's line is its own `check --run` verdict."""
    own = {run_id: run_verdict(fleet_db, run_id, capsys) for run_id in (1, 2)}
    assert own[2] == 1 and own[1] != 1
    assert main(["check", str(fleet_db), "--fleet", "f1", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert (found["fleet"], found["verdict"], found["exit_code"]) == ("f1", "leak", 1)
    assert [(r["rank"], r["run"], r["exit_code"]) for r in found["replicas"]] == [(0, 1, own[1]), (1, 2, 1)]
    assert main(["check", str(fleet_db), "--fleet", "f1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [
        f"{fleet_db} fleet f1 rank 0 (run 1)",
        f"{fleet_db} fleet f1 rank 1 (run 2)",
        f"{fleet_db} fleet f1",
    ]
    assert lines[-1].endswith("leak (2 replicas)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fleet", "nope"], "no fleet 'nope' in this capture: it has f1, old"),
        (["--fleet", "--run", "1"], "--run and --fleet cannot be used together"),
    ],
)
def test_check_fleet_bad_input_is_one_line(
    fleet_db: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(fleet_db), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_fleet_missing_a_declared_replica_is_inconclusive_never_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `--dp-size 3` fleet whose capture holds ranks 0 and 2 only: the clean replicas do not make
    the fleet clean, rank 1 was never checked."""
    from kvscope.telemetry import LeakCheck
    from tests.fleet.fleet_capture import usage, write_replica

    path = tmp_path / "partial.db"
    for rank in (0, 2):
        config = {"fleet": {"id": "p", "size": 3, "dispatch": "round_robin", "rank": rank}}
        write_replica(path, config, [], usage(2, 60, 10, 18, 6), LeakCheck(2, "full", 100, 96, 4, 0, 0, 0), [])
    assert main(["check", str(path), "--fleet", "p", "--run", "1"]) == 2
    capsys.readouterr()
    for rank in (1, 2):
        assert main(["check", str(path), "--run", str(rank)]) == 0  # each present replica alone is clean
    capsys.readouterr()
    assert main(["check", str(path), "--fleet", "p"]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        f"{path} fleet p rank 1: inconclusive: no run of this replica in the capture (the fleet declares 3), "
        "so it was never checked"
    )
    assert lines[-1] == f"{path} fleet p: inconclusive (2 replicas of 3)"
    assert main(["check", str(path), "--fleet", "p", "--json"]) == 3
    found = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["run"], r["exit_code"]) for r in found["replicas"]] == [(0, 1, 0), (1, None, 3), (2, 2, 0)]
    assert found["verdict"] == "inconclusive"


def test_check_fleet_before_the_capture_reads_as_after_it(fleet_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    after = main(["check", str(fleet_db), "--fleet"]), capsys.readouterr()
    before = main(["check", "--fleet", str(fleet_db)]), capsys.readouterr()
    assert before == after and after[1].out.startswith(f"{fleet_db} fleet old rank 0")
    assert main(["check"]) == 2
    assert capsys.readouterr().err == (
        "kvscope check: error: name the capture to check: kvscope check CAPTURE [--fleet [ID]]\n"
    )
