"""The host-leak fault through the CLI: `kvscope run --cache hiradix --inject host-leak` leaks
host copies, and `kvscope check` / `kvscope report leaks` name pool host, the node whose copy
left the tree, its slots and the failed [host] leak check; asked for on a cache without a host
tier, it is one error line, exit 2, and no capture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app import main

RUN = ["run", "--workload", "multi-turn", "--num-requests", "16", "--seed", "1", "--chunked-prefill-size", "64"]
TIGHT = ["--cache", "hiradix", "--kv-tokens", "400", "--host-tokens", "300"]  # host copies do leave the tree


def kvscope(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, check=False, cwd=cwd
    )


def test_a_host_leak_run_fails_the_check_naming_the_host_pool_and_the_node(tmp_path: Path) -> None:
    ran = kvscope(*RUN, *TIGHT, "--inject", "host-leak:0.4", "--inject-seed", "5", "--capture", "c.db", cwd=tmp_path)
    assert ran.returncode == 1 and "pool host" in ran.stdout, ran.stdout + ran.stderr  # run exits 1 on a leak
    check = kvscope("check", "c.db", cwd=tmp_path)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "orphaned" in check.stdout and "pool host" in check.stdout
    report = json.loads(kvscope("report", "leaks", "c.db", "--json", cwd=tmp_path).stdout)
    injected = {(i["node_id"], tuple(sorted(i["slots"]))) for i in report["injected"]}
    assert injected and {i["kind"] for i in report["injected"]} == {"host-leak"}
    leaks = {(leak["node_id"], tuple(leak["slots"])) for leak in report["leaks"] if leak["pool"] == "host"}
    assert leaks == injected
    text = kvscope("report", "leaks", "c.db", cwd=tmp_path).stdout
    node, slots = min(injected)
    assert f"culprit: node {node}; held by node {node}'s host copy, which left the tree at step" in text
    assert str(slots[0]) in text
    assert any(line.strip().startswith("[host]") and line.endswith(" tokens missing") for line in text.splitlines())


def test_host_leak_without_a_host_tier_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main([*RUN, "--cache", "radix", "--inject", "host-leak", "--capture", "c.db"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "kvscope run: error: fault host-leak needs a host tier (--cache hiradix)", err
    assert list(tmp_path.iterdir()) == []
