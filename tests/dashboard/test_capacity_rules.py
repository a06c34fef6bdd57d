"""The Capacity page draws the curve of each cache's sharing rule, or says what its curve assumes:
real captures (`kvscope run` on the scoped cache, a real `kvscope serve`, the hybrid SWA sample)
through the real app (AppTest)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.app import main
from kvscope.planning import load_requests, one_pass_curve
from tests.dashboard.conftest import ROOT
from tests.server.serving import serving

TIMEOUT_S = 120


def capacity_page(db: Path, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT_S).run()
    at.switch_page("kvscope/dashboard/app_pages/capacity.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def curves_drawn(at: AppTest) -> dict[str, np.ndarray]:
    """Series name -> hit rates of the page's curve figure."""
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    return {trace["name"]: values(trace["y"]) for trace in spec["data"]}


def values(encoded: Any) -> np.ndarray:
    """A plotly JSON array: a list, or a typed array ({"dtype", "bdata": base64})."""
    if isinstance(encoded, dict):
        return np.frombuffer(base64.b64decode(encoded["bdata"]), dtype=encoded["dtype"])
    return np.asarray(encoded, dtype=float)


def assumption(at: AppTest) -> str:
    lines = [c.value for c in at.caption if c.value.startswith("**What the curve assumes.**")]
    assert len(lines) == 1, [c.value for c in at.caption]
    return lines[0]


def scoped_run(tmp_path: Path, name: str, *cache_args: str) -> Path:
    capture = tmp_path / f"{name}.db"
    code = main(
        [
            "run",
            "--workload",
            "multi-tenant",
            "--num-requests",
            "8",
            "--level",
            "summary",
            "--capture",
            str(capture),
            "--no-report",
            "--cache",
            "scoped-radix",
            *cache_args,
        ]
    )
    assert code == 0
    return capture


def test_a_scoped_run_that_never_promotes_draws_the_isolated_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture = scoped_run(tmp_path, "isolated", "--promote-k", "inf")
    at = capacity_page(capture, monkeypatch)
    requests = load_requests(str(capture))
    isolated = one_pass_curve(requests, isolated=True)
    glob = one_pass_curve(requests)
    assert isolated.max_hit_rate < glob.max_hit_rate  # NOTE: the control: the rules differ on this traffic
    drawn = curves_drawn(at)
    assert list(drawn) == ["token hit rate, per-principal isolation"]
    expected = np.concatenate(([0.0], isolated.hit_rate(isolated.breakpoints()[0])))
    assert np.allclose(drawn["token hit rate, per-principal isolation"], expected)
    assert "Per-principal isolation, as this run's scoped cache" in assumption(at)


def test_a_scoped_run_with_a_threshold_draws_both_extremes_and_says_neither_is_its_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = capacity_page(scoped_run(tmp_path, "threshold", "--promote-k", "3", "--epoch-s", "30"), monkeypatch)
    assert list(curves_drawn(at)) == ["token hit rate, global sharing", "token hit rate, per-principal isolation"]
    line = assumption(at)
    assert "once 3 of them computed it" in line and "no one-pass curve follows that rule" in line
    assert "--promote-k 3 --epoch-s 30" in line
    assert any(m.label == "capacity for 50% (global sharing)" for m in at.metric)


def test_an_swa_run_says_the_curve_leaves_out_its_swa_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    at = capacity_page(ROOT / "sample_runs" / "hybrid-swa.db", monkeypatch)
    assert list(curves_drawn(at)) == ["token hit rate"]
    line = assumption(at)
    assert "full-attention pool alone" in line and "last 32 tokens" in line and "SWA pool" in line


def test_a_radix_run_names_global_sharing(monkeypatch: pytest.MonkeyPatch) -> None:
    at = capacity_page(ROOT / "sample_runs" / "shared-prefix.db", monkeypatch)
    assert list(curves_drawn(at)) == ["token hit rate"]
    assert "Global sharing, as this run's radix cache" in assumption(at)


def test_a_serve_capture_says_in_one_line_why_it_has_no_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    capture = tmp_path / "serve.db"
    with serving(capture, "--level", "full") as server:
        for user in ("alice", "bob"):
            server.client().completions.create(
                model="kvscope-tiny", prompt="the same system prompt", max_tokens=2, user=user
            )
        assert server.stop()[0] == 0
    at = capacity_page(capture, monkeypatch)
    assert not at.get("plotly_chart")
    (info,) = [i.value for i in at.info]
    assert info.startswith(
        "No hit-rate curve for this run: a `kvscope serve` capture stores each request's lengths, not its token ids"
    )
    assert "\n" not in info and "neither a workload nor a trace" not in info
    assert main(["replay", str(capture), "--curve-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not its token ids" in err, err
