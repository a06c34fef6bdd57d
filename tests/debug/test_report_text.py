"""The leak report as text: a long list of leaks can be cut to its first few."""

from __future__ import annotations

from pathlib import Path

from kvscope.debug.report import build_report, render_text

ROOT = Path(__file__).resolve().parents[2]


def test_the_text_report_can_list_only_the_first_leaks() -> None:
    report = build_report(ROOT / "sample_runs" / "leaky.db")
    assert len(report.leaks) > 3
    text = render_text(report, max_leaks=2)
    assert "  2. " in text and "  3. " not in text
    assert f"… and {len(report.leaks) - 2:,} more" in text
    assert "more (kvscope" not in render_text(report)
