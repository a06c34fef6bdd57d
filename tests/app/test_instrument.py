"""`kvscope instrument`: sets the probe's environment and execs the engine's command; bad input is
one line and exit 2 (the command never starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOW_ENV = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('KVSCOPE_')}))"


def kvscope(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "VLLM_PLUGINS"))}
    return subprocess.run([sys.executable, "-m", "kvscope", "instrument", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120, check=False)


def test_it_execs_the_command_with_the_probes_environment(tmp_path: Path) -> None:
    capture = tmp_path / "probe.db"
    out = kvscope("--capture", str(capture), "--level", "summary", "--", sys.executable, "-c", SHOW_ENV)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"KVSCOPE_CAPTURE": str(capture), "KVSCOPE_LEVEL": "summary",
                                      "KVSCOPE_PYTHON": sys.executable}
    assert out.stderr == f"kvscope instrument: recording into {capture} (level summary); then kvscope check {capture}\n"
    assert capture.exists()  # made before the engine starts: a bad path fails here, not inside the engine


def test_the_commands_exit_code_is_its_own(tmp_path: Path) -> None:
    out = kvscope("--capture", str(tmp_path / "c.db"), "--", sys.executable, "-c", "raise SystemExit(7)")
    assert out.returncode == 7


@pytest.mark.parametrize(("args", "env", "line"), [
    ((), None, "kvscope instrument: error: name the engine's command after --, e.g. kvscope instrument -- vllm serve "
               "MODEL"),
    (("--", "no-such-engine-cmd"), None, "kvscope instrument: error: no-such-engine-cmd: command not found"),
    (("--", "true"), {"VLLM_PLUGINS": "lora_filesystem_resolver"},
     "kvscope instrument: error: VLLM_PLUGINS='lora_filesystem_resolver' would keep vLLM from loading the probe: "
     "add kvscope to it"),
    (("--level", "debug", "--", "true"), None, "kvscope instrument: error: argument --level: invalid choice: 'debug' "
                                               "(choose from 'summary', 'full')"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], env: dict[str, str] | None,
                                          line: str) -> None:
    out = kvscope("--capture", str(tmp_path / "c.db"), *args, env=env)
    assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", "")


def test_a_capture_it_cannot_write_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_text("not a database")
    out = kvscope("--capture", str(bad), "--", "true")
    assert (out.returncode, out.stderr) == (2, f"kvscope instrument: error: {bad}: not a kvscope capture "
                                               "(not a SQLite database)\n")
