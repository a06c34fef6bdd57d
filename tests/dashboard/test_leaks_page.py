"""The Leaks page on the leaking sample (one idle check, 22 root causes, six locks never released):
the terms at that check as bars, a culprit table that fits, links to the request and the node, the
44-vs-20 slots of the lock on node 31 explained, and who holds a node's locks on the tree page."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard.leak_views import held_locks, holders_of, lock_paths, slot_ranges, split_off_since
from kvscope.debug import Leak
from tests.dashboard.conftest import ROOT

TIMEOUT_S = 60
LEAKY = ROOT / "sample_runs" / "leaky.db"


def open_page(page: str, monkeypatch: pytest.MonkeyPatch, params: dict[str, str] | None = None) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(LEAKY))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT_S)
    at.query_params.update(params or {})
    at.switch_page(f"kvscope/dashboard/app_pages/{page}.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def page_links(at: AppTest) -> list[Any]:
    return [link.proto for link in at.get("page_link")]


def test_one_idle_check_shows_its_terms_as_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page("leaks", monkeypatch)
    assert any(h.value == "Invariant terms at the idle check (step 38)" for h in at.subheader)
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    full = spec["data"][0]
    assert full["type"] == "bar"
    assert dict(zip(full["x"], full["y"], strict=True)) == {
        "available": 260,
        "evictable": 988,
        "protected": 760,
        "held": 0,
        "uncached": 0,
        "missing": 40,
    }


def test_the_culprit_table_is_short_and_names_request_and_node(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page("leaks", monkeypatch)
    table = at.dataframe[0].value
    assert list(table.columns) == ["#", "kind", "slots", "request", "user", "node", "note"]
    assert len(table) == 24
    lock = table[table["node"] == "31"].iloc[0]
    assert (lock["kind"], lock["slots"], lock["request"]) == ("lock-never-released", "20: 1300–1319", "mt-c0005-t3")
    assert table["note"].str.len().max() < 90  # wraps in its column, no event numbers or repeated names
    assert table.loc[table["#"] == 14, "note"].iloc[0].startswith("a consequence of #10")


def test_a_culprit_links_to_its_request_and_a_locked_node_to_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page("leaks", monkeypatch)
    links = {link.page: link.query_string for link in page_links(at)}
    assert links["requests"] == f"capture={str(LEAKY).replace('/', '%2F')}&run=1&rid=mt-c0009-t0"  # culprit #1
    trees = [link.query_string for link in page_links(at) if link.page == "tree"]
    assert f"capture={str(LEAKY).replace('/', '%2F')}&run=1&step=38&node=31" in trees
    assert len(trees) == 6  # one per lock never released


def test_the_lock_on_node_31_is_44_slots_when_locked_and_20_now(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page("leaks", monkeypatch)
    paths = at.dataframe[1].value.set_index("node")
    row = paths.loc[31]
    assert (row["slots in the report"], row["slots when locked"], row["slots on the path to the root"]) == (20, 44, 200)
    assert row["split off since"] == "node 70 at step 33 (24 slots)"
    explained = [i.value for i in at.info if i.value.startswith("Node 31:")]
    assert len(explained) == 1 and "44 slots" in explained[0] and "says 20" in explained[0]
    assert (paths["slots in the report"] == paths["slots when locked"]).sum() == 5  # no split under the others


def test_a_locked_node_lists_the_requests_holding_it(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page("tree", monkeypatch, {"step": "38", "node": "31"})
    holders = at.dataframe[1].value
    assert holders.to_dict("records") == [{"request": "mt-c0005-t3", "locked node": 31, "since step": 22}]
    at.selectbox(key="tree.node").set_value(2).run()  # node 2 is above three leaked locks (and others)
    assert {"mt-c0005-t3", "mt-c0006-t2", "mt-c0002-t2"} <= set(at.dataframe[1].value["request"])


def lock(node: int, rid: str, step: int, seq: int, kind: str = "lock") -> dict[str, Any]:
    return {"seq": seq, "step": step, "kind": kind, "rid": rid, "node_id": node, "num_tokens": 0, "aux": 0}


def test_held_locks_pair_each_unlock_with_the_same_request_and_node() -> None:
    events = pd.DataFrame(
        [
            lock(5, "a", 1, 1),
            lock(5, "b", 2, 2),
            lock(5, "a", 3, 3, "unlock"),
            lock(6, "c", 4, 4),
            lock(6, "c", 9, 5, "unlock"),
        ]
    )
    assert held_locks(events, 4).to_dict("records") == [
        {"node_id": 5, "rid": "b", "since_step": 2},
        {"node_id": 6, "rid": "c", "since_step": 4},
    ]
    assert held_locks(events, 9)["rid"].tolist() == ["b"]
    tree = pd.DataFrame({"node_id": [0, 5, 6], "parent_id": [None, 0, 5]})
    assert holders_of(5, held_locks(events, 4), tree)["request"].tolist() == ["b", "c"]  # c locked the child
    assert holders_of(6, held_locks(events, 4), tree)["request"].tolist() == ["c"]


def test_splits_after_a_lock_are_put_back_together() -> None:
    splits = pd.DataFrame(
        [
            {"seq": 5, "step": 2, "node_id": 70, "aux": 31},
            {"seq": 9, "step": 4, "node_id": 80, "aux": 70},
            {"seq": 12, "step": 5, "node_id": 90, "aux": 12},
        ]
    )
    assert split_off_since(31, 1, splits) == [(70, 2), (80, 4)]
    assert split_off_since(31, 6, splits) == []  # splits before the lock do not count
    tree = pd.DataFrame({"node_id": [31, 70, 80], "num_tokens": [20, 14, 10], "depth_tokens": [200, 180, 166]})
    leak = Leak("lock-never-released", "full", list(range(20)), "r", allocated_step=1, allocated_event=1, node_id=31)
    row = lock_paths([leak], tree, splits).iloc[0]
    assert (row["slots in the report"], row["slots when locked"], row["slots on the path to the root"]) == (20, 44, 200)


def test_slot_ranges_are_short() -> None:
    assert slot_ranges([3, 1, 2, 7, 9, 10]) == "1–3, 7, 9–10"
    assert slot_ranges(list(range(0, 20, 2)), limit=2) == "0, 2, … +8 ranges"
