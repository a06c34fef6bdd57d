"""A hiradix run says the same thing everywhere: the tokens evicted (the run summary, the usage
samples `diff` reads, the Evictions page's events), and protected tokens with no request running
are "never released" only where the leak report names such a lock. The Radix tree's root counts
every lock held below it."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.debug import build_report
from tests.dashboard.conftest import ROOT
from tests.dashboard.test_pages import open_app, page_path

# NOTE: load-back evicts device leaves to make room for what it loads: these are evictions too
HIRADIX = (
    "run",
    "--workload",
    "shared-prefix",
    "--num-requests",
    "24",
    "--cache",
    "hiradix",
    "--kv-tokens",
    "1024",
    "--host-ratio",
    "2",
)


@pytest.fixture(scope="module")
def hiradix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("hiradix") / "hi.db"
    done = subprocess.run(
        [sys.executable, "-m", "kvscope", *HIRADIX, "--capture", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return path, done.stdout


def metrics(at: object) -> dict[str, object]:
    return {m.label: m for m in at.metric}  # type: ignore[attr-defined]


def test_evicted_tokens_agree_in_the_summary_the_samples_and_the_evictions_page(
    hiradix: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, summary = hiradix
    printed = int(re.search(r"evicted tokens\s+(\d+)", summary).group(1))  # type: ignore[union-attr]
    with sqlite3.connect(path) as conn:
        sampled = conn.execute("SELECT cum_evicted_tokens FROM usage ORDER BY step DESC LIMIT 1").fetchone()[0]
        num_loads = conn.execute("SELECT count(*) FROM requests WHERE cached_tokens > 0").fetchone()[0]
    assert num_loads > 0
    at = open_app(path, monkeypatch)
    at.switch_page(page_path("evictions")).run()
    assert not at.exception
    shown = int(metrics(at)["evicted tokens"].value.replace(",", ""))  # type: ignore[attr-defined]
    assert printed == sampled == shown > 0


def test_protected_tokens_are_not_called_a_leak_when_the_leak_check_finds_none(
    hiradix: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = hiradix
    with sqlite3.connect(path) as conn:
        step, protected, running = conn.execute(
            "SELECT step, full_protected, num_running FROM usage ORDER BY step DESC LIMIT 1"
        ).fetchone()
        checked = conn.execute("SELECT protected FROM leak_checks WHERE pool = 'full' AND step = ?", (step,)).fetchone()
    assert running == 0 and protected > 0 and checked == (0,), "the capture no longer shows copies in flight"
    at = open_app(path, monkeypatch)
    assert not at.exception and at.success  # clean
    shown = metrics(at)["full: protected"]
    assert shown.value == f"{protected:,}"  # type: ignore[attr-defined]
    assert "never released" not in shown.help and "copies still in flight" in shown.help  # type: ignore[attr-defined]
    said = [c.value for c in at.caption if "protected with no request running" in c.value]
    assert len(said) == 1 and f"full: {protected:,} protected" in said[0] and "copies still in flight" in said[0]


def test_a_leaked_lock_is_called_never_released(monkeypatch: pytest.MonkeyPatch) -> None:
    leaky = ROOT / "sample_runs" / "leaky.db"
    never = [leak for leak in build_report(leaky).leaks if leak.kind == "lock-never-released"]
    at = open_app(leaky, monkeypatch)
    assert f"names {len(never)} lock(s) that were never released" in metrics(at)["full: protected"].help  # type: ignore[attr-defined]


def test_the_roots_caption_counts_every_lock_held_below_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """leaky.db ends idle: every lock still held at its last step is one never released."""
    leaky = ROOT / "sample_runs" / "leaky.db"
    never = [leak for leak in build_report(leaky).leaks if leak.kind == "lock-never-released"]
    assert len(never) > 1
    at = open_app(leaky, monkeypatch)
    at.switch_page(page_path("tree")).run()
    root = int(at.selectbox(key="tree.node").options[0])
    at.selectbox(key="tree.node").set_value(root).run()
    assert not at.exception
    captions = [c.value for c in at.caption if "root's own lock" in c.value]
    assert captions and f": {len(never)} lock(s) held at step " in captions[0], captions
    holders = [d.value for d in at.dataframe if list(d.value.columns) == ["request", "locked node", "since step"]]
    assert len(holders) == 1 and len(holders[0]) == len(never)
