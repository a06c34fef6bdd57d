"""Every page through the real app (AppTest) on every sample capture; bad files; the picker."""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvscope.dashboard.frame import find_captures, requested_capture
from tests.dashboard.conftest import PAGES, ROOT
from tests.telemetry.oracle_reads import unpack_to_rows

TIMEOUT_S = 60


def open_app(db: Path | str, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    return AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT_S).run()


def page_path(page: str) -> str:
    return f"kvscope/dashboard/app_pages/{page}.py"


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_every_sample(sample: Path, page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(sample, monkeypatch)
    if page != "overview":
        at.switch_page(page_path(page)).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.header and at.header[0].value.lower().startswith(page[:4] if page != "tree" else "radix")


def test_overview_shows_both_hit_rates_labelled(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(ROOT / "sample_runs" / "shared-prefix.db", monkeypatch)
    labels = {m.label: m.value for m in at.metric}
    # shared-prefix: 5558 of 7705 prompt tokens hit; 44 of 48 requests
    assert labels["hit rate: tokens"] == "72.1%"
    assert labels["hit rate: requests"] == "91.7%"
    assert at.success[0].value.startswith("**clean: 1 idle leak check balanced")


def test_leaks_page_names_the_injected_culprits(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(ROOT / "sample_runs" / "leaky.db", monkeypatch)
    at.switch_page(page_path("leaks")).run()
    assert {m.label: m.value for m in at.metric}["verdict"] == "leak"
    culprits = at.dataframe[0].value
    assert {"orphaned", "double-free", "lock-never-released"} <= set(culprits["kind"])
    assert culprits["request"].notna().any()


def test_leaks_page_uses_the_stored_report_and_replays_when_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_app(ROOT / "sample_runs" / "leaky.db", monkeypatch)
    at.switch_page(page_path("leaks")).run()
    assert any("stored with the capture" in c.value for c in at.caption)
    stored = at.dataframe[0].value
    path = tmp_path / "leaky.db"
    path.write_bytes((ROOT / "sample_runs" / "leaky.db").read_bytes())
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM reports")
    at = open_app(path, monkeypatch)
    at.switch_page(page_path("leaks")).run()
    assert not at.exception and any("Replayed from the capture" in c.value for c in at.caption)
    assert at.dataframe[0].value.equals(stored)


def test_memory_page_counts_wasted_slots_with_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(ROOT / "sample_runs" / "leaky.db", monkeypatch)  # page size 4
    at.switch_page(page_path("memory")).run()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["page size"] == "4 tokens" and int(metrics["wasted slots"]) > 0


def test_tree_time_travel_changes_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(ROOT / "sample_runs" / "hybrid-swa.db", monkeypatch)
    at.switch_page(page_path("tree")).run()
    late = at.caption[0].value
    at.slider(key="tree.step").set_value(5).run()
    assert not at.exception
    assert at.caption[0].value != late and at.caption[0].value.startswith("Step 5:")


def test_token_previews_are_off_until_turned_on(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(ROOT / "sample_runs" / "shared-prefix.db", monkeypatch)
    at.switch_page(page_path("tree")).run()
    assert "token preview" not in set(at.dataframe[0].value["field"])
    at.toggle(key="tree.preview").set_value(True).run()
    assert "token preview" in set(at.dataframe[0].value["field"])


@pytest.mark.parametrize("content", [b"", b"hello, not a database" * 10, b"SQLite format 3\x00" + b"\x00" * 200])
def test_a_bad_file_shows_one_line_not_a_traceback(
    tmp_path: Path, content: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(content)
    at = open_app(bad, monkeypatch)
    assert not at.exception
    assert len(at.error) == 1 and str(bad) in at.error[0].value and "\n" not in at.error[0].value


def test_a_missing_file_shows_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(tmp_path / "nope.db", monkeypatch)
    assert not at.exception and "no such file" in at.error[0].value


def test_the_picker_switches_captures_and_lists_run_status(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(ROOT / "sample_runs" / "leaky.db", monkeypatch)
    assert at.sidebar.selectbox(key="kvscope.run").options == ["run 1 · multi-turn · finished"]
    other = next(o for o in at.sidebar.selectbox(key="kvscope.capture").options if o.endswith("shared-prefix.db"))
    at.sidebar.selectbox(key="kvscope.capture").set_value(other).run()
    assert not at.exception
    assert at.sidebar.selectbox(key="kvscope.run").options == ["run 1 · shared-prefix · finished"]


def test_db_argument_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_DB", "env.db")
    assert requested_capture(["--db", "arg.db"]) == "arg.db"
    assert requested_capture([]) == "env.db"
    monkeypatch.delenv("KVSCOPE_DB")
    assert requested_capture(["--other", "x"]) is None


def test_newest_capture_under_runs_comes_first(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "sample_runs").mkdir()
    (tmp_path / "sample_runs" / "s.db").write_bytes(b"x")
    old, new = tmp_path / "runs" / "old.db", tmp_path / "runs" / "new.db"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    os.utime(old, (1, 1))
    found = find_captures((tmp_path / "runs", tmp_path / "sample_runs"))
    assert [p.name for p in found] == ["new.db", "old.db", "s.db"]


def test_no_page_loads_torch() -> None:
    """Every page (the Leaks page imports kvscope.debug.report) in a fresh interpreter, torch never loaded."""
    code = (
        "import sys, os\n"
        "from streamlit.testing.v1 import AppTest\n"
        f"os.environ['KVSCOPE_DB'] = {str(ROOT / 'sample_runs' / 'leaky.db')!r}\n"
        f"at = AppTest.from_file({str(ROOT / 'app.py')!r}, default_timeout=60).run()\n"
        f"for page in {PAGES[1:]!r}:\n"
        "    at.switch_page(f'kvscope/dashboard/app_pages/{page}.py').run()\n"
        "    assert not at.exception, at.exception\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_capacity_page_plans_a_gpu_and_marks_the_capacity_a_target_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(ROOT / "sample_runs" / "shared-prefix.db", monkeypatch)
    at.switch_page(page_path("capacity")).run()
    assert not at.exception, [e.value for e in at.exception]
    shown = {m.label: m.value for m in at.metric}
    assert shown["KV bytes per token"] == "131,072"  # llama-3.1-8b, bf16: 2 x 8 heads x 128 x 32 layers x 2 bytes
    assert int(shown["max KV tokens (SGLang)"].replace(",", "")) > 0
    at.slider(key="capacity.target").set_value(0.3).run()
    assert not at.exception
    assert any(m.label == "capacity for 30%" for m in at.metric)
    at.number_input(key="capacity.gpu").set_value(8.0).run()
    assert at.error and "do not fit" in at.error[0].value


def test_a_damaged_page_met_by_a_page_read_is_one_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged page in a capture too big for the check at open: each page shows one message, and the
    Overview, whose verdict is read from the stored report (no event read), says it is damaged too: a
    verdict checks every page first (Capture.check_pages), as `kvscope check`'s replay meets them."""
    from kvscope.telemetry import store

    path = tmp_path / "damaged.db"
    shutil.copy(ROOT / "sample_runs" / "leaky.db", path)
    unpack_to_rows(path)  # NOTE: the row layout; damaged packed chunks are another case
    with sqlite3.connect(path) as conn:
        page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        leaves = [p for (p,) in conn.execute("SELECT pageno FROM dbstat WHERE name = 'events' AND pagetype = 'leaf'")]
    conn.close()
    with path.open("r+b") as fh:
        for page in leaves:  # the events table only: the runs, usage and checks stay readable
            fh.seek(page_size * (page - 1))
            fh.write(random.Random(page).randbytes(page_size))
    monkeypatch.setattr(store, "QUICK_CHECK_MAX_BYTES", 0)
    damaged_pages = 0
    for page in PAGES:
        at = open_app(path, monkeypatch)
        if page != "overview":
            at.switch_page(page_path(page)).run()
        assert not at.exception, (page, [e.value for e in at.exception])
        errors = [e.value for e in at.error if "damaged capture" in e.value]
        assert all("\n" not in e for e in errors), errors
        damaged_pages += bool(errors)
        if page == "overview":
            assert len(errors) == 1 and not at.success, (errors, [s.value for s in at.success])
    assert 0 < damaged_pages < len(PAGES)  # the pages that read events or give a verdict say so; the others render


@pytest.mark.parametrize(
    "damage",
    [
        "DROP TABLE event_chunks; DROP TABLE event_columns; DROP TABLE event_strings",
        "UPDATE event_chunks SET num_events = 1000",
        "UPDATE event_columns SET dtype = '<c9' WHERE name = 'kind'",
    ],
    ids=["tables-gone", "count-disagrees", "unknown-dtype"],
)
def test_every_page_shows_one_message_on_damaged_packed_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A schema-6 capture whose packed events are missing or inconsistent: every page says it is damaged
    (in one line), none raises, none shows a verdict read from what is left."""
    path = tmp_path / "packed.db"
    shutil.copy(ROOT / "sample_runs" / "shared-prefix.db", path)
    upgraded = subprocess.run(
        [sys.executable, "-m", "kvscope", "upgrade", str(path)], capture_output=True, cwd=ROOT, check=False
    )
    assert upgraded.returncode == 0, upgraded.stderr
    with sqlite3.connect(path) as conn:
        conn.executescript(damage)
    conn.close()
    for page in PAGES:
        at = open_app(path, monkeypatch)
        if page != "overview":
            at.switch_page(page_path(page)).run()
        assert not at.exception, (page, [e.value for e in at.exception])
        errors = [e.value for e in at.error]
        assert len(errors) == 1 and f"{path}: damaged capture (" in errors[0] and "\n" not in errors[0], (page, errors)
        assert not at.success and not at.metric, (page, [s.value for s in at.success])
