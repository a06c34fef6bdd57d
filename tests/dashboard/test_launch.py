"""`make run`'s launcher: the engine writes a fresh capture under runs/ and the dashboard opens exactly it."""

from __future__ import annotations

from pathlib import Path

from kvscope.dashboard import launch


def test_the_dashboard_opens_the_capture_the_engine_writes(tmp_path: Path) -> None:
    capture = launch.live_capture_path(tmp_path / "runs", now=0.0)
    assert capture.parent == tmp_path / "runs" and capture.name.endswith("-live.db")
    engine = launch.engine_command(capture, "multi-turn", 200, 4.0)
    assert engine[1:4] == ["-m", "kvscope", "run"]
    assert engine[engine.index("--capture") + 1] == str(capture) and engine[engine.index("--pace") + 1] == "4.0"
    dashboard = launch.dashboard_command(capture, port=8999)
    assert dashboard[-3:] == ["--", "--db", str(capture)] and "8999" in dashboard
    assert dashboard[dashboard.index("run") + 1] == str(launch.ROOT / "app.py")
