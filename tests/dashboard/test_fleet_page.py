"""The Fleet page in Streamlit's AppTest: replicas side by side, duplication and routing loss of a
hand-computed fleet (tests/fleet/fleet_capture.py); one line where the capture cannot show them."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard.charts.fleet import duplication_figure, routing_figure
from kvscope.dashboard.data import LIVE_TTL_S
from tests.dashboard.conftest import ROOT
from tests.fleet.fleet_capture import write_fleet

FLEET_PAGE = "kvscope/dashboard/app_pages/fleet.py"


@pytest.fixture(scope="module")
def fleet_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fleet") / "fleet.db"
    write_fleet(path)
    return path


def open_fleet_page(db: Path, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    at.sidebar.selectbox[1].set_value(1).run()  # the run picker: run 1, rank 0 of fleet f1
    at.switch_page(FLEET_PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_fleet_page_shows_replicas_duplication_and_routing_loss(
    fleet_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_fleet_page(fleet_db, monkeypatch)
    assert at.header[0].value == "Fleet"
    assert at.selectbox(key="fleet.id").value == "f1"  # the selected run's fleet
    replicas = at.dataframe[0].value
    assert replicas["rank"].tolist() == [0, 1] and replicas["idle_floor_tokens"].tolist() == [4, 10]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["held (all replicas)"] == "12" and metrics["unique"] == "8"
    assert metrics["duplicated"] == "4 (33.3%)"
    routing = at.dataframe[1].value.set_index("dispatch")
    assert routing.loc["round_robin", "loss_share"] == pytest.approx(40.0)  # NOTE: percent, shown as 40.00%


def test_a_fleet_without_page_hashes_says_so_in_one_line(fleet_db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_fleet_page(fleet_db, monkeypatch)
    at.selectbox(key="fleet.id").set_value("old").run()
    assert not at.exception
    assert not at.metric  # no duplication figures
    captions = [c.value for c in at.caption]
    assert any(c.startswith("duplication: not known") for c in captions)


def test_a_capture_without_a_fleet_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_fleet_page(ROOT / "sample_runs" / "leaky.db", monkeypatch)
    assert at.info[0].value.startswith("No fleet in this capture")


def test_chart_builders_draw_the_figures() -> None:
    dup = pd.DataFrame({"t_s": [0.0, 1.0], "unique_tokens": [8, 9], "duplicated_tokens": [4, 2]})
    fig = duplication_figure(dup)
    assert [t.name for t in fig.data] == ["unique", "duplicated"] and list(fig.data[1].y) == [4, 2]
    routing = pd.DataFrame({"dispatch": ["round_robin"], "loss_share": [0.0071]})
    fig = routing_figure(routing)
    assert list(fig.data[0].y) == [0.0071] and fig.layout.yaxis.tickformat == ".2~%"  # 0.71%, not "1%"


def test_the_page_follows_the_fleet_while_another_replica_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's run has finished and is the one selected; rank 1's is still recording: the page keeps
    refreshing (it follows the fleet, not only the selected run)."""
    from kvscope.telemetry import SQLRecorder

    path = tmp_path / "live.db"
    fleet = {"id": "lv", "size": 2, "dispatch": "round_robin"}
    with SQLRecorder(path, config={"fleet": {**fleet, "rank": 0}}):
        pass
    with SQLRecorder(path, config={"fleet": {**fleet, "rank": 1}}) as running:
        running.flush()
        at = open_fleet_page(path, monkeypatch)
        captions = [c.value for c in at.caption]
        assert "runs of this page still running · this page refreshes every second" in captions, captions
    time.sleep(LIVE_TTL_S + 0.2)  # NOTE: the run list is cached this long; a live page reads it again then
    at = open_fleet_page(path, monkeypatch)  # both finished: nothing to follow
    assert not any("refreshes every second" in c.value for c in at.caption), [c.value for c in at.caption]
