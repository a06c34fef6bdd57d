"""`check`, `report leaks` and `diff` read the leak report stored when the run closed while it
still describes the run, and replay the events when it does not (none stored, out of date,
unreadable) or with --replay; each says which. A stored report that no longer matches the
capture is never read: its verdict could be a false clean."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from kvscope.app.cli import main
from kvscope.debug.report import build_report, save_report

ROOT = Path(__file__).resolve().parents[2]


def kvscope(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def as_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = kvscope(capsys, *args, "--json")
    assert code in (0, 1, 3), err
    shape: dict[str, Any] = json.loads(out)
    return shape


def with_one_leak(tmp_path: Path) -> Path:
    """The leaking sample, its stored report cut to its first leak: a replay finds them all, so
    what each verb prints shows which report it read."""
    path = tmp_path / "leaky.db"
    shutil.copy(ROOT / "sample_runs" / "leaky.db", path)
    report = build_report(path)
    assert len(report.leaks) > 1
    save_report(path, dataclasses.replace(report, leaks=report.leaks[:1]))
    return path


def test_check_report_and_diff_read_the_stored_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(with_one_leak(tmp_path))
    stored, replayed = as_json(capsys, "check", path), as_json(capsys, "check", path, "--replay")
    assert (stored["source"], replayed["source"]) == ("stored", "replayed")
    assert stored["verdict"] == replayed["verdict"] == "leak" and stored["exit_code"] == replayed["exit_code"] == 1
    assert "more" not in stored["reason"] and replayed["reason"].startswith(stored["reason"] + " and ")
    code, out, err = kvscope(capsys, "check", path)
    assert code == 1 and out == f"{path}: {stored['reason']}\n"
    assert err.startswith("kvscope check: from the leak report stored when the run closed, built ")
    assert "replayed from the capture's events (--replay)" in kvscope(capsys, "check", path, "--replay")[2]

    report = as_json(capsys, "report", "leaks", path)
    assert (report["source"], len(report["leaks"])) == ("stored", 1) and report["stored_at"] is not None
    again = as_json(capsys, "report", "leaks", path, "--replay")
    assert again["source"] == "replayed" and len(again["leaks"]) > 1 and again["verdict"] == report["verdict"]
    text = kvscope(capsys, "report", "leaks", path)[1].splitlines()
    assert text[1].startswith("report: from the leak report stored when the run closed")

    sides = as_json(capsys, "diff", path, path)
    assert [sides[s]["source"] for s in "ab"] == ["stored", "stored"] and sides["a"]["reason"] == stored["reason"]
    fresh = as_json(capsys, "diff", path, path, "--replay")
    assert [fresh[s]["source"] for s in "ab"] == ["replayed", "replayed"] and fresh["a"]["reason"] == replayed["reason"]


# NOTE: each makes the clean sample's stored report stale or unreadable; the first two also make
# the run leak, so a verb that read the stored report would say clean where the capture says leak
STALE: dict[str, str | tuple[str, str]] = {
    "a leak check failed after it was built": (
        "UPDATE leak_checks SET ok = 0, available = available - 5, message = 'x: 5 tokens missing' WHERE pool = 'full'"
    ),
    "a leak check added after it was built": (
        "leak_checks",  # copied to the step after its last, with these changes
        "ok = 0, available = available - 5, message = 'x: 5 tokens missing'",
    ),
    "steps recorded after it was built": ("usage", ""),
    "it misses the last event": "UPDATE reports SET through_seq = through_seq - 1",
    "another version built it": "UPDATE reports SET producer = 'kvscope 0.0.1 / leak report 0'",
    "its body is not JSON": "UPDATE reports SET body = '{not json'",
    "its body is JSON of another shape": "UPDATE reports SET body = '[1, 2]'",
    "it is another run's": "UPDATE reports SET body = replace(body, '\"run_id\": 1,', '\"run_id\": 2,')",
    "none was stored": "DELETE FROM reports",
}


def make_stale(path: Path, change: str) -> None:
    conn = sqlite3.connect(path)
    with conn:
        stale = STALE[change]
        if isinstance(stale, str):
            conn.execute(stale)
        else:  # (table, changes): its rows of its last step copied to the step after, changed
            table, changes = stale
            columns = ", ".join(row[1] for row in conn.execute(f"PRAGMA table_info({table})"))
            conn.execute(
                f"CREATE TEMP TABLE later AS SELECT * FROM {table} WHERE step = (SELECT max(step) FROM {table})"
            )
            conn.execute(f"UPDATE later SET step = step + 1{', ' + changes if changes else ''}")
            conn.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM later")
    conn.close()


@pytest.mark.parametrize("change", list(STALE), ids=list(STALE))
def test_a_stale_or_unreadable_stored_report_is_replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str
) -> None:
    path = tmp_path / "clean.db"
    shutil.copy(ROOT / "sample_runs" / "shared-prefix.db", path)
    assert as_json(capsys, "check", str(path))["source"] == "stored"
    make_stale(path, change)
    found, fresh = as_json(capsys, "check", str(path)), as_json(capsys, "check", str(path), "--replay")
    assert found["source"] == "replayed", found
    assert {k: v for k, v in found.items() if k != "source"} == {k: v for k, v in fresh.items() if k != "source"}
    leaks = change.startswith("a leak check")
    assert found["verdict"] == ("leak" if leaks else "clean"), found
    why = "no report was stored" if change == "none was stored" else "the stored one no longer describes the run"
    assert f"replayed from the capture's events ({why})" in kvscope(capsys, "check", str(path))[2]
    assert as_json(capsys, "report", "leaks", str(path))["source"] == "replayed"
    assert as_json(capsys, "diff", str(path), str(path))["a"]["source"] == "replayed"
