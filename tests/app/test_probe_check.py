"""`kvscope probe-check`: its help, and bad input in one line with exit 2 (no traceback). What it says of
a real engine's code is tested on vLLM's (tests/engines/test_vllm_probe.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app.probe_check import LEVELS, render

ROOT = Path(__file__).resolve().parents[2]


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "probe-check", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )


def test_help_says_what_a_shape_and_a_family_are_and_the_exit_codes() -> None:
    out = kvscope("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "--python PATH" in text and "--json" in text
    assert "leading parameters and the attributes the probe reads (a shape)" in text
    assert "Exit 0: the probe loads on every engine found; 1:" in text


def test_a_python_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "python"
    out = kvscope("--python", str(missing))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"kvscope probe-check: error: {missing}: no such python\n"


def test_an_environment_without_an_engine_is_one_line_and_exit_2() -> None:
    """kvscope's own venv has neither vLLM nor SGLang."""
    out = kvscope("--python", sys.executable)
    assert (out.returncode, out.stdout) == (2, "")
    assert (
        out.stderr
        == f"kvscope probe-check: error: {sys.executable}: neither vLLM nor SGLang is installed in its environment\n"
    )


def test_a_python_that_cannot_run_the_check_is_one_line_and_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no python here' >&2\nexit 3\n")
    broken.chmod(0o755)
    out = kvscope("--python", str(broken))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"kvscope probe-check: error: the probe check failed: {broken} exited 3: no python here\n"


@pytest.mark.parametrize(("engine", "default"), [("vLLM", "full"), ("SGLang", "summary")])
def test_the_levels_lines_mark_the_engines_default(engine: str, default: str) -> None:
    """Each engine's default level (DEFAULT_LEVEL: what stays within 1 µs per wrapped call there) is
    marked; an older kvscope's answer without the field marks none."""
    found = {"engine": engine, "version": "1", "plugin_installed": True, "loads": True, "family": "1", "tested": True}
    found |= {"line": "", "targets": [], "records": ["usage"], "families": []}
    marked = [
        line for line in render([{**found, "default_level": default}], "python").splitlines() if "(the default)" in line
    ]
    assert marked == [f"    --level {default} (the default): {LEVELS[default]}"]
    assert "(the default)" not in render([found], "python")
