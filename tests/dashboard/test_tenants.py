"""The tenant filter and the sharing views through the real app (AppTest) on a real capture of a
multi-tenant workload on the radix cache (global sharing), and their pure tables and charts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import charts, data, tenants, timing
from kvscope.telemetry import MAX_RELATIVE_ERROR, Capture, reuse_by_principal, tenant_of
from tests.dashboard.conftest import ROOT

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def capture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "multi-tenant.db"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "run",
            "--workload",
            "multi-tenant",
            "--num-requests",
            "24",
            "--cache",
            "radix",
            "--capture",
            str(path),
            "--no-report",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return path


def open_page(db: Path, page: str, monkeypatch: pytest.MonkeyPatch, params: dict[str, str] | None = None) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT_S)
    at.query_params.update(params or {})
    at.switch_page(f"kvscope/dashboard/app_pages/{page}.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def request_count(at: AppTest) -> int:
    return int({m.label: m.value for m in at.metric}["requests"].replace(",", ""))


def test_the_sidebar_lists_the_runs_tenants_and_defaults_to_all(
    capture_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(capture_path, "requests", monkeypatch)
    picker = at.selectbox(key=tenants.TENANT_KEY)
    requests = Capture(capture_path).requests(1)
    assert picker.value == tenants.ALL_TENANTS
    assert list(picker.options) == [tenants.ALL_TENANTS, *sorted({tenant_of(p) for p in requests["principal"]})]
    assert request_count(at) == len(requests) == 24  # the control: all tenants, every request


def test_picking_a_tenant_filters_the_requests_and_goes_in_the_url(
    capture_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(capture_path, "requests", monkeypatch)
    at.selectbox(key=tenants.TENANT_KEY).set_value("t1").run()
    assert not at.exception
    requests = Capture(capture_path).requests(1)
    of_t1 = int(sum(tenant_of(p) == "t1" for p in requests["principal"]))
    assert 0 < of_t1 < len(requests)
    assert request_count(at) == of_t1
    assert at.query_params["tenant"] == ["t1"] or at.query_params["tenant"] == "t1"
    at.selectbox(key=tenants.TENANT_KEY).set_value(tenants.ALL_TENANTS).run()
    assert request_count(at) == len(requests) and "tenant" not in at.query_params


def test_a_link_opens_with_its_tenant_and_a_bad_one_is_a_note(
    capture_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(capture_path, "requests", monkeypatch, {"tenant": "t2"})
    assert at.selectbox(key=tenants.TENANT_KEY).value == "t2"
    assert not any("tenant" in i.value for i in at.info)
    bad = open_page(capture_path, "requests", monkeypatch, {"tenant": "nobody"})
    assert bad.selectbox(key=tenants.TENANT_KEY).value == tenants.ALL_TENANTS
    assert any("tenant 'nobody'" in i.value for i in bad.info)


def test_past_the_exact_bound_a_tenants_latencies_come_from_its_histograms(
    capture_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The histogram read (a run past data.EXACT_LATENCIES_MAX requests, here lowered to 0) through the page:
    the caption says so, and the tenant's table is the exact one to within MAX_RELATIVE_ERROR."""
    monkeypatch.setattr(data, "EXACT_LATENCIES_MAX", 0)
    at = open_page(capture_path, "requests", monkeypatch, {"tenant": "t1"})
    assert any("latency histograms" in c.value for c in at.caption)
    requests = Capture(capture_path).requests(1)
    of_t1 = requests[[tenant_of(p) == "t1" for p in requests["principal"]]]
    exact = timing.latency_percentiles(timing.latencies(of_t1)).set_index("latency")
    shown = at.dataframe[0].value.set_index("latency")
    assert shown["requests"].tolist() == exact["requests"].tolist()
    for column in ("p50 (ms)", "p90 (ms)", "p99 (ms)", "max (ms)"):
        for name in exact.index:
            bound = MAX_RELATIVE_ERROR * exact.loc[name, column] + 0.001
            assert abs(shown.loc[name, column] - exact.loc[name, column]) <= bound, (name, column)


def test_memory_page_shows_reuse_share_tokens_per_tenant_and_why_there_are_no_promotions(
    capture_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(capture_path, "memory", monkeypatch)
    reuse = reuse_by_principal(Capture(capture_path), 1)
    share = reuse["cross_tokens"].sum() / reuse["matched_tokens"].sum()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["cross-principal reuse share"] == f"{share:.1%}"
    captions = " ".join(c.value for c in at.caption)
    assert "No promotions or demotions: this run used the radix cache (global sharing" in captions
    assert "From the latest tree snapshot" in captions
    at.selectbox(key=tenants.TENANT_KEY).set_value("t2").run()
    of_t2 = tenants.reuse_share(reuse, "t2")
    assert {m.label: m.value for m in at.metric}[
        "cross-principal reuse share (requests of tenant t2)"
    ] == f"{of_t2.share:.1%}"


def test_tree_page_colours_by_visibility_and_by_owner(capture_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(capture_path, "tree", monkeypatch)
    for field in ("visibility", "owner"):
        at.selectbox(key="tree.color").set_value(field).run()
        assert not at.exception, [e.value for e in at.exception]
    at.selectbox(key=tenants.TENANT_KEY).set_value("t0").run()
    nodes = at.selectbox(key="tree.node").options
    tree = Capture(capture_path).tree_at(1, int(at.slider(key="tree.step").value)).set_index("node_id")
    assert nodes and all(tenant_of(tree.loc[int(n), "owner"]) == "t0" for n in nodes)


def test_cache_by_tenant_sums_tokens_by_owner_tenant_and_visibility() -> None:
    nodes = pd.DataFrame(
        {
            "node_id": [0, 1, 2, 3, 4],
            "parent_id": [None, 0, 1, 0, 0],
            "num_tokens": [0, 8, 4, 5, 2],
            "owner": [None, "t1-a", "t1-b", "acme/x", None],
            "visibility": [None, "public", "private", "private", None],
        }
    )
    table = tenants.cache_by_tenant(nodes)
    assert table.to_dict("records") == [
        {"tenant": "acme", "visibility": "private", "num_tokens": 5, "num_nodes": 1},
        {"tenant": "no owner", "visibility": "visibility not recorded", "num_tokens": 2, "num_nodes": 1},
        {"tenant": "t1", "visibility": "private", "num_tokens": 4, "num_nodes": 1},
        {"tenant": "t1", "visibility": "public", "num_tokens": 8, "num_nodes": 1},
    ]
    figure = charts.cache_by_tenant_figure(table)
    assert [t.name for t in figure.data] == ["private", "public", "visibility not recorded"]


def test_visibility_changes_chart_puts_demotions_below_zero() -> None:
    changes = pd.DataFrame({"step": [2, 3], "kind": ["promote", "demote"], "num_events": [2, 1], "num_tokens": [7, 6]})
    figure = charts.visibility_changes_figure(changes)
    assert {t.name: list(t.y) for t in figure.data} == {"promoted tokens": [7], "demoted tokens": [-6]}


def test_reuse_share_of_no_matches_is_none_not_zero() -> None:
    empty = pd.DataFrame(columns=["principal", "matched_tokens", "cross_tokens"])
    assert tenants.reuse_share(empty, None).share is None
    some = pd.DataFrame({"principal": ["t1-a", "t2-b"], "matched_tokens": [10, 30], "cross_tokens": [5, 0]})
    assert tenants.reuse_share(some, None).share == 5 / 40
    assert tenants.reuse_share(some, "t2").share == 0.0
