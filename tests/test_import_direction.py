"""Layers import downward only (DESIGN.md); the dashboard and app.py never touch torch or
the engine layers, so a capture opens on a laptop without them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each package may import from kvscope (itself included). Downward only:
# cli/server -> engine -> cache -> mem -> telemetry.events.
ALLOWED: dict[str, set[str]] = {
    "telemetry": {"telemetry"},
    "workloads": {"workloads"},
    "mem": {"mem", "telemetry"},
    "cache": {"cache", "mem", "telemetry"},
    "debug": {"debug", "telemetry", "mem", "cache"},
    "engine": {"engine", "cache", "mem", "telemetry", "workloads", "debug"},
    "planning": {"planning", "telemetry", "cache", "mem", "workloads"},
    "server": {"server", "engine", "cache", "mem", "telemetry", "workloads", "debug"},
    "dashboard": {"dashboard", "telemetry", "planning", "debug"},
}
TOP_LEVEL_MODULES = {"cli", "__init__"}  # kvscope/cli.py may import anything
NO_TORCH = {"dashboard"}


def kvscope_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def package_of(path: Path) -> str:
    return path.relative_to(ROOT / "kvscope").parts[0].removesuffix(".py")


def test_layers_import_downward_only() -> None:
    violations = []
    for path in sorted((ROOT / "kvscope").rglob("*.py")):
        package = package_of(path)
        if package in TOP_LEVEL_MODULES:
            continue
        assert package in ALLOWED, f"new package {package!r}: add its allowed imports to this test"
        for line, module in kvscope_imports(path):
            parts = module.split(".")
            if parts[0] == "kvscope" and len(parts) > 1 and parts[1] not in ALLOWED[package]:
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if package in NO_TORCH and parts[0] == "torch":
                violations.append(f"{path.relative_to(ROOT)}:{line} imports torch")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_app_imports_only_the_dashboard_side() -> None:
    allowed = ALLOWED["dashboard"]
    bad = [
        f"app.py:{line} imports {module}"
        for line, module in kvscope_imports(ROOT / "app.py")
        if module.split(".")[0] == "torch"
        or (module.startswith("kvscope.") and module.split(".")[1] not in allowed)
    ]
    assert not bad, "\n".join(bad)


def test_app_runs_without_loading_torch() -> None:
    """Load app.py's imports in a fresh interpreter and prove torch never got imported."""
    code = (
        "import runpy, sys\n"
        "from streamlit.testing.v1 import AppTest\n"
        f"at = AppTest.from_file({str(ROOT / 'app.py')!r}).run(timeout=60)\n"
        "assert not at.exception, at.exception\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", "app.py pulled torch in"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """Guard against a checker that cannot fail: an upward import is reported."""
    bad = tmp_path / "mod.py"
    bad.write_text("from kvscope.engine import scheduler\nimport torch\n")
    modules = [m for _, m in kvscope_imports(bad)]
    assert modules == ["kvscope.engine", "torch"]
    assert "engine" not in ALLOWED["mem"] and "engine" not in ALLOWED["dashboard"]
