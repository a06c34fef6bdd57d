"""Fleet figures against a hand-computed fleet (tests/fleet/fleet_capture.py) and their properties."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscope.fleet.figures import duplication, fleet_figures, fleets, loose_runs, pick_fleet
from kvscope.telemetry import Capture, SQLRecorder
from tests.fleet.fleet_capture import write_fleet


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Capture:
    path = tmp_path_factory.mktemp("fleet") / "fleet.db"
    write_fleet(path)
    return Capture(path)


def test_runs_group_into_fleets_by_their_fleet_keys(capture: Capture) -> None:
    found = fleets(capture)
    assert [(f.id, [(r.rank, r.run_id) for r in f.replicas]) for f in found] == [
        ("f1", [(0, 1), (1, 2)]),
        ("old", [(0, 3)]),
    ]
    assert loose_runs(capture, found) == [4]
    assert pick_fleet(found, None).id == "old" and pick_fleet(found, "f1").id == "f1"
    with pytest.raises(ValueError, match="no fleet 'nope'"):
        pick_fleet(found, "nope")


def test_replicas_side_by_side(capture: Capture) -> None:
    figures = fleet_figures(capture, pick_fleet(fleets(capture), "f1"))
    rows = figures.replicas.set_index("rank")
    assert rows["usage"].tolist() == [0.3, 0.5]
    assert rows["hit_rate"].tolist() == pytest.approx([6 / 18, 0.0])
    assert rows["running"].tolist() == [1, 1] and rows["waiting"].tolist() == [2, 2]
    assert rows.loc[0, "leak_check"] == "ok" and rows.loc[1, "leak_check"].startswith("leak: ")
    assert rows["idle_floor_tokens"].tolist() == [4, 10]


def test_routing_loss_per_method_is_a_share_of_prompt_tokens(capture: Capture) -> None:
    routing = fleet_figures(capture, pick_fleet(fleets(capture), "f1")).routing.set_index("dispatch")
    assert routing.loc["round_robin", ["num_requests", "prompt_tokens", "loss_tokens"]].tolist() == [2, 20, 8]
    assert routing.loc["round_robin", "loss_share"] == pytest.approx(0.4)
    assert routing.loc["prefix_affinity", ["num_requests", "loss_tokens", "loss_share"]].tolist() == [1, 0, 0.0]


def test_duplicated_prefixes_count_k_minus_one_times(capture: Capture) -> None:
    figures = fleet_figures(capture, pick_fleet(fleets(capture), "f1"))
    last = figures.duplication.iloc[-1]
    assert (last["held_tokens"], last["unique_tokens"], last["duplicated_tokens"], last["unknown_tokens"]) == (
        12,
        8,
        4,
        0,
    )
    assert not figures.notes


def test_a_fleet_without_page_hashes_says_duplication_is_not_known(capture: Capture) -> None:
    figures = fleet_figures(capture, pick_fleet(fleets(capture), "old"))
    assert figures.duplication.empty
    assert any(note.startswith("duplication: not known") for note in figures.notes)
    assert any(note.startswith("routing loss:") for note in figures.notes)


pages = st.dictionaries(st.binary(min_size=8, max_size=8), st.integers(1, 16), max_size=6)


@given(st.lists(st.dictionaries(st.sampled_from([bytes([i]) * 8 for i in range(8)]), st.just(2)), max_size=5))
def test_unique_plus_duplicated_is_the_replicas_held_sum(replicas: list[dict[bytes, int]]) -> None:
    found = duplication(replicas)
    assert found.unique_tokens + found.duplicated_tokens == sum(sum(r.values()) for r in replicas)
    assert found.unique_tokens == 2 * len(set().union(*replicas)) if replicas else found.unique_tokens == 0


@given(st.lists(pages, min_size=1, max_size=1))
def test_one_replica_duplicates_nothing(replicas: list[dict[bytes, int]]) -> None:
    assert duplication(replicas).duplicated_tokens == 0


def test_vllm_data_parallel_ranks_group_by_host_each_rank_once(tmp_path: Path) -> None:
    """Instrumented vLLM EngineCores carry their DP rank; a rank seen again opens the next fleet."""
    path = tmp_path / "vllm.db"
    for rank in (0, 1, 0):
        with SQLRecorder(path, config={"source": {"kind": "probe", "engine": "vllm", "dp_rank": rank}}):
            pass
    with SQLRecorder(path, config={"source": {"kind": "probe", "engine": "vllm", "dp_rank": None}}):
        pass
    capture = Capture(path)
    found = fleets(capture)
    assert [(f.source, [(r.rank, r.run_id) for r in f.replicas]) for f in found] == [
        ("vllm", [(0, 1), (1, 2)]),
        ("vllm", [(0, 3)]),
    ]
    assert loose_runs(capture, found) == [4]
