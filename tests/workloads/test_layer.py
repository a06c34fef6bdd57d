"""kvscope.workloads is a bottom layer: the standard library and numpy only, never torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvscope" / "workloads"


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module)
    return roots


def test_imports_only_the_standard_library_numpy_and_itself() -> None:
    bad = []
    for path in sorted(PACKAGE.glob("*.py")):
        for module in imported_roots(path):
            root = module.split(".")[0]
            allowed = root in sys.stdlib_module_names or root == "numpy" or module.startswith("kvscope.workloads")
            if not allowed:
                bad.append(f"{path.name} imports {module}")
    assert not bad, "\n".join(bad)


def test_importing_the_package_loads_no_torch() -> None:
    code = "import sys, kvscope.workloads; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
