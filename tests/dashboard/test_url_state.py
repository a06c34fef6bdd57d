"""The view in the URL (capture, run, page, step, node, request) through the real app, a bad link
falling back with a note, and the tree's step kept while a live run grows."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard import data, frame
from kvscope.dashboard.url_state import link, parse
from kvscope.telemetry import PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard.conftest import ROOT

TIMEOUT_S = 60
LEAKY = ROOT / "sample_runs" / "leaky.db"


def open_link(db: Path | str, page: str, params: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> AppTest:
    """The app as a pasted link opens it: the page's URL path and its query parameters."""
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT_S)
    at.query_params.update(params)
    at.switch_page(f"kvscope/dashboard/app_pages/{page}.py")
    return at.run()


def test_parse_keeps_good_values_and_notes_bad_ones() -> None:
    parsed = parse({"capture": "runs/a.db", "run": "2", "step": "17", "node": "x1", "rid": "", "other": "y"})
    assert parsed.values == {"capture": "runs/a.db", "run": 2, "step": 17}
    assert len(parsed.notes) == 2 and "node 'x1' is not a whole number" in parsed.notes[0]
    assert parse({"step": "-3"}).values == {} and parse({"run": "1e3"}).values == {}
    assert parse({"rid": "a\x00b"}).values == {}
    assert link("tree", capture="a b.db", run=1, step=None) == "tree?capture=a+b.db&run=1"


def test_a_link_opens_the_tree_at_its_step_and_node(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_link(
        LEAKY, "tree", {"capture": "sample_runs/leaky.db", "run": "1", "step": "20", "node": "31"}, monkeypatch
    )
    assert not at.exception, [e.value for e in at.exception]
    assert at.caption[0].value.startswith("Step 20:")
    assert at.slider(key="tree.step").value == 20 and at.selectbox(key="tree.node").value == 31
    assert not at.info  # nothing to say about a good link


def test_the_url_follows_the_view(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_link(LEAKY, "tree", {}, monkeypatch)
    assert _param(at, "capture") == str(LEAKY) and _param(at, "step") == "38"
    at.slider(key="tree.step").set_value(25).run()
    assert _param(at, "step") == "25" and _param(at, "run") == "1"
    at.switch_page("kvscope/dashboard/app_pages/leaks.py").run()
    assert _param(at, "step") is None and _param(at, "node") is None  # a page's keys stay on its page
    assert _param(at, "capture") == str(LEAKY)


def _param(at: AppTest, key: str) -> str | None:
    value = at.query_params.get(key)
    return value[0] if isinstance(value, list) else value


@pytest.mark.parametrize(
    "params, note",
    [
        ({"step": "abc"}, "step 'abc' is not a whole number"),
        ({"step": "999"}, "step 999 is outside this run's steps 1–38"),
        ({"run": "7"}, "run 7 is not in this capture"),
        ({"capture": "/etc/passwd"}, "capture '/etc/passwd' is not one this dashboard lists"),
        ({"node": "4242", "step": "20"}, "node 4242 is not in the tree at this step"),
    ],
)
def test_a_bad_link_falls_back_with_a_note(params: dict[str, str], note: str, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_link(LEAKY, "tree", params, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    assert any(note in i.value for i in at.info), [i.value for i in at.info]
    assert at.caption[0].value.startswith("Step 20:" if params.get("step") == "20" else "Step 38:")


def test_a_link_to_a_request_shows_that_request(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_link(LEAKY, "requests", {"rid": "mt-c0005-t3"}, monkeypatch)
    assert not at.exception
    assert at.selectbox(key="requests.rid").value == "mt-c0005-t3"
    assert at.dataframe[-1].value["rid"].tolist() == ["mt-c0005-t3"]
    at = open_link(LEAKY, "requests", {"rid": "nobody"}, monkeypatch)
    assert any("request 'nobody' is not in this run" in i.value for i in at.info)
    assert len(at.dataframe[-1].value) == 32


def usage(step: int) -> UsageSample:
    return UsageSample(step, PoolTerms(100, 60, 30, 10), None, 4, 2, 2, step, 10 * step, 5 * step, step, step, 0, 0)


def grow(recorder: SQLRecorder, steps: range) -> None:
    for step in steps:
        recorder.step = step
        recorder.usage(usage(step))
    recorder.flush()
    time.sleep(data.LIVE_TTL_S + 0.1)  # the run list (and so every read's stamp) is cached this long


def test_the_chosen_step_stays_while_a_live_run_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "live.db"
    recorder = SQLRecorder(db, level="full", label="live")
    try:
        grow(recorder, range(10))
        at = open_link(db, "tree", {}, monkeypatch)
        assert at.caption[0].value.startswith("Step 9:")  # following the newest step
        grow(recorder, range(10, 12))
        at.run()
        assert at.caption[0].value.startswith("Step 11:")
        at.slider(key="tree.step").set_value(3).run()
        assert at.toggle(key="tree.follow").value is False
        grow(recorder, range(12, 15))
        at.run()
        assert not at.exception
        assert at.slider(key="tree.step").max == 14 and at.caption[0].value.startswith("Step 3:")
        at.toggle(key="tree.follow").set_value(True).run()
        assert at.caption[0].value.startswith("Step 14:")
    finally:
        recorder.close()


def test_a_stale_url_echo_of_the_live_tree_step_does_not_turn_follow_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page writes its step to the URL every second; a rerun that carries the browser's URL from
    before the last write (step 9, written by this session) is no link: 'follow newest' stays on."""
    db = tmp_path / "live.db"
    recorder = SQLRecorder(db, level="full", label="live")
    try:
        grow(recorder, range(10))
        at = open_link(db, "tree", {}, monkeypatch)
        assert at.caption[0].value.startswith("Step 9:")
        grow(recorder, range(10, 12))
        at.run()
        assert at.caption[0].value.startswith("Step 11:")
        at.query_params["step"] = "9"  # NOTE: the browser's URL, one write behind
        at.run()
        assert at.toggle(key="tree.follow").value is True
        grow(recorder, range(12, 14))
        at.run()
        assert at.caption[0].value.startswith("Step 13:")
    finally:
        recorder.close()


def test_every_status_reads_the_same_in_the_picker_and_the_status_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "ends.db"
    for status, error in (
        ("finished", None),
        ("interrupted", None),
        ("crashed", "ValueError: boom"),
        ("incomplete", "capture complete through step 2: database or disk is full"),
    ):
        recorder = SQLRecorder(db, level="summary", label=status)
        grow(recorder, range(3))
        recorder.close(status, error)
    for run_id, status, error in (
        (3, "crashed", "ValueError: boom"),
        (4, "incomplete", "capture complete through step 2: database or disk is full"),
        (2, "interrupted", None),
    ):
        at = open_link(db, "overview", {"run": str(run_id)}, monkeypatch)
        assert not at.exception, [e.value for e in at.exception]
        picker = at.sidebar.selectbox(key="kvscope.run")
        assert picker.value == run_id and picker.format_func(run_id).endswith(f"· {status}")
        lines = [c.value for c in at.sidebar.caption]
        assert lines[0].startswith(f"status: **{status}**")
        assert (error in lines) if error else len(lines) == 1


def test_a_capture_named_absolute_and_relative_is_listed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.db").write_bytes(b"")
    (tmp_path / "runs" / "b.db").write_bytes(b"")
    found = frame.find_captures((Path("runs"),))
    options = frame.capture_options(str(tmp_path / "runs" / "a.db"), found)
    assert len(options) == 2 and options[0] == str(tmp_path / "runs" / "a.db")
    assert frame.capture_options("sqlite:///runs/a.db", found)[0] == "sqlite:///runs/a.db"


def test_the_x_axis_is_in_the_url_and_a_link_opens_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory's (and the Overview's) wall-clock axis is the URL's x=time: picked, the URL says so; a
    link with it opens the chart on wall-clock time; a bad value is a note and the step axis."""
    at = open_link(LEAKY, "memory", {}, monkeypatch)
    assert _param(at, "x") is None
    next(r for r in at.radio if r.label == "x axis").set_value("wall-clock time").run()
    assert _param(at, "x") == "time"
    linked = open_link(LEAKY, "memory", {"x": "time"}, monkeypatch)
    assert not linked.exception, [e.value for e in linked.exception]
    assert next(r for r in linked.radio if r.label == "x axis").value == "wall-clock time"
    bad = open_link(LEAKY, "memory", {"x": "hours"}, monkeypatch)
    assert next(r for r in bad.radio if r.label == "x axis").value == "step"
    assert any("x 'hours' is not step or time" in i.value for i in bad.info)
