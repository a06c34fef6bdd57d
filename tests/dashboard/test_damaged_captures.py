"""Issue 40, point 18, on the dashboard: a damaged capture (tests/damage_corpus.py) is one error line on
every page, the line `kvscope check` prints, and no page shows a verdict or raises. One file of each shape
(the CLI's test, tests/app/test_damaged_captures.py, runs them all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.telemetry import store
from tests.damage_corpus import corpus
from tests.dashboard.conftest import PAGES
from tests.dashboard.test_pages import open_app, page_path

SHAPES = (
    "tail-cut-1000B",
    "tail-kept-50pct",
    "no-column-requests.dispatch",
    "no-column-event_chunks.chunk",
    "no-table-leak_checks",
    "garbage-page-event_columns",
    "schema-version-abc",
)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return corpus(tmp_path_factory.mktemp("damaged"))


@pytest.mark.parametrize("shape", SHAPES)
def test_every_page_shows_one_damaged_line_and_no_verdict(
    damaged: dict[str, Path], shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = damaged[shape]
    for page in PAGES:
        at = open_app(path, monkeypatch)
        if page != "overview":
            at.switch_page(page_path(page)).run()
        assert not at.exception, (page, [e.value for e in at.exception])
        errors = [e.value for e in at.error]
        assert len(errors) == 1 and f"{path}: damaged capture (" in errors[0] and "\n" not in errors[0], (page, errors)
        assert not at.success and not at.metric, (page, [s.value for s in at.success])


def test_a_large_captures_verdict_waits_for_every_page(
    damaged: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the size checked at open, a damaged page the Overview's stored report never reads is still
    found before its verdict (Capture.check_pages): one line, as `kvscope check` says."""
    monkeypatch.setattr(store, "QUICK_CHECK_MAX_BYTES", 0)
    path = damaged["garbage-page-event_columns"]
    at = open_app(path, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and f"{path}: damaged capture (quick_check: " in errors[0], errors
    assert not at.success, [s.value for s in at.success]
