"""One meaning of "used" for the device pool: SGLang's, total - free - evictable (its kv_used_tokens),
on the engine Overview as in the capture's full_used (what `kvscope diff` reads) and in serve's
/metrics; total - free is called "allocated" (the Overview's live chart)."""

from __future__ import annotations

import pandas as pd
import pytest

from kvscope.dashboard import charts
from kvscope.telemetry.queries import Capture
from tests.dashboard.test_pages import open_app
from tests.dashboard.test_verdict_and_counts import LEAKY, metrics


def test_the_overview_says_used_as_sglang_and_diff_do(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = metrics(open_app(LEAKY, monkeypatch))
    capture = Capture(str(LEAKY))
    try:
        last = capture.usage(1).iloc[-1]
    finally:
        capture.close()
    used = int(last.full_total - last.full_available - last.full_evictable)
    assert used == int(last.full_used) == 800  # 2,048 - 260 free - 988 evictable: 760 protected + 40 missing
    assert shown["full: used"] == f"{used:,}"


def test_the_live_chart_calls_total_minus_free_allocated() -> None:
    usage = pd.DataFrame(
        {
            "step": [1, 2],
            "full_total": [100, 100],
            "full_available": [60, 40],
            "full_evictable": [10, 30],
            "full_protected": [5, 5],
            "num_running": [1, 1],
            "num_waiting": [0, 0],
        }
    )
    figure = charts.live_usage_figure(usage)
    names = [trace.name for trace in figure.data]
    assert "full allocated" in names and "full used" not in names
    assert list(figure.data[names.index("full allocated")].y) == [0.4, 0.6]
