"""The committed sample captures (sample_runs/) are what `make samples` writes with this code: the
current schema, one file each, closed, with a leak report the current debugger would store and
the cross-principal reuse the Memory page shows; a fresh `make samples` run records the same.
When one of these fails after a change to what captures hold, run `make samples` and commit."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.dashboard.tenants import reuse_share
from kvscope.debug.report import stored_report
from kvscope.telemetry import schema
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.sharing import reuse_by_principal

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_runs"
# `kvscope check` of each, as sample_runs/README.md states it
CHECK_CODES = {"shared-prefix.db": 0, "hybrid-swa.db": 0, "leaky.db": 1}
STALE = "sample_runs/ is stale: run `make samples` and commit the captures"


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, check=False, cwd=ROOT
    )


def makefile_samples() -> list[str]:
    """The capture names the Makefile's `samples` recipe writes."""
    return re.findall(r"--capture \$\(SAMPLES_DIR\)/([\w-]+\.db)", (ROOT / "Makefile").read_text())


def test_the_samples_are_the_ones_the_makefile_writes_and_the_readme_lists() -> None:
    names = makefile_samples()
    assert sorted(names) == sorted(CHECK_CODES) == sorted(p.name for p in SAMPLES.glob("*.db"))
    readme = (SAMPLES / "README.md").read_text()
    for name, code in CHECK_CODES.items():
        assert re.search(rf"\| `{re.escape(name)}` \|.*\| {code} \(", readme), name


@pytest.mark.parametrize("name", sorted(CHECK_CODES))
def test_a_sample_is_one_closed_file_of_the_current_schema(name: str) -> None:
    path = SAMPLES / name
    header = path.read_bytes()[:100]
    assert header[18:20] == b"\x01\x01", f"{name} is in WAL mode (readers would leave files beside it); {STALE}"
    capture = Capture(path)
    assert capture.schema_version == schema.SCHEMA_VERSION, f"{name} is schema {capture.schema_version}; {STALE}"
    runs = capture.runs()
    assert list(runs.status) == ["finished"] and list(runs.level) == ["full"], name
    run_id = int(runs.id.iloc[0])
    assert stored_report(capture, run_id) is not None, f"{name} has no leak report the debugger takes; {STALE}"
    reuse = reuse_share(reuse_by_principal(capture, run_id), None)
    assert reuse.share is not None, f"{name} records no cross-principal reuse for the Memory page; {STALE}"
    capture.close()
    check = kvscope("check", str(path))
    assert check.returncode == CHECK_CODES[name], check.stdout + check.stderr


@pytest.mark.slow
def test_make_samples_records_what_the_committed_sample_holds(tmp_path: Path) -> None:
    """The first sample regenerated with the Makefile's own command line: the same events, metrics,
    leak-check terms, verdict and settings (the environment and capture path aside)."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    venv = Path(sys.executable).parents[1]
    recipe = subprocess.run(
        [
            "make",
            "-n",
            "--no-print-directory",
            "-o",
            f"{venv}/.kvscope-installed",
            "samples",
            f"VENV={venv}",
            f"SAMPLES_DIR={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (command,) = [line for line in recipe.splitlines() if "shared-prefix.db" in line and " run " in line]
    subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, check=True)
    fresh = tmp_path / "shared-prefix.db"
    diff = json.loads(kvscope("diff", str(fresh), str(SAMPLES / "shared-prefix.db"), "--json").stdout)
    a, b = diff["a"], diff["b"]
    for key in ("status", "events", "metrics", "last_check", "verdict"):
        assert a[key] == b[key], f"{key} differ: {a[key]} vs {b[key]}; {STALE}"
    settings = {key for key in diff["config_differences"] if not key.startswith(("environment.", "capture"))}
    assert not settings, f"settings differ: {sorted(settings)}; {STALE}"
