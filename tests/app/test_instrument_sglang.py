"""`kvscope instrument` in front of SGLang: an SGLANG_PLUGINS allowlist without kvscope would keep
SGLang's load_plugins() from running the probe, so kvscope is appended to it (the user's plugins stay),
as it is to VLLM_PLUGINS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kvscope(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "VLLM_PLUGINS", "SGLANG_PLUGINS"))}
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "instrument", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
        check=False,
    )


def test_an_sglang_allowlist_without_kvscope_gets_kvscope_appended(tmp_path: Path) -> None:
    show = "import json, os; print(json.dumps(os.environ['SGLANG_PLUGINS']))"
    out = kvscope(
        "--capture", str(tmp_path / "c.db"), "--", sys.executable, "-c", show, env={"SGLANG_PLUGINS": "my_platform"}
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == "my_platform,kvscope"


def test_an_sglang_allowlist_naming_kvscope_runs_the_command(tmp_path: Path) -> None:
    show = "import json, os; print(json.dumps(os.environ['SGLANG_PLUGINS']))"
    out = kvscope(
        "--capture",
        str(tmp_path / "c.db"),
        "--",
        sys.executable,
        "-c",
        show,
        env={"SGLANG_PLUGINS": "my_platform, kvscope"},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == "my_platform, kvscope"
