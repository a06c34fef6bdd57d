"""Layers import downward only (docs/architecture.md), with no exceptions: app -> server / attach ->
engine -> cache -> mem -> telemetry, workloads at the bottom beside telemetry. The engine
imports neither the debugger nor the SQL store; the dashboard and app.py never touch torch
or the engine layers, so a capture opens on a laptop without them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvscope"

# What each package may import from kvscope (itself included).
ALLOWED: dict[str, set[str]] = {
    "telemetry": {"telemetry"},
    "workloads": {"workloads"},
    "fleet": {"fleet", "telemetry"},  # dispatch methods and fleet figures: pure logic over telemetry reads
    "mem": {"mem", "telemetry"},
    "cache": {"cache", "mem", "telemetry"},
    "engine": {"engine", "cache", "mem", "telemetry", "workloads"},
    "server": {"server", "fleet", "engine", "cache", "mem", "telemetry", "workloads"},
    "attach": {"attach", "telemetry"},  # beside a real engine on a box without torch (kvscope/attach/__init__.py)
    "probe": {"probe", "telemetry"},  # runs inside a real engine's venv: stdlib, numpy and telemetry only
    "debug": {"debug", "fleet", "telemetry", "mem"},  # mem: the KV pool types whose freed rows the monitor poisons
    "planning": {"planning", "fleet", "cache", "mem", "workloads", "telemetry"},
    "dashboard": {"dashboard", "fleet", "telemetry", "debug", "planning"},
    "app": {
        "app",
        "fleet",
        "server",
        "attach",
        "probe",
        "engine",
        "cache",
        "mem",
        "telemetry",
        "workloads",
        "debug",
        "planning",
        "dashboard",
    },
    "__init__": set(),  # kvscope/__init__.py holds the version and imports nothing
    "__main__": {"app"},  # `python -m kvscope`
}
# The engine writes telemetry and never reads it back: from telemetry it imports the package
# face, and from the face only the producer side (the names events.py and records.py define:
# event kinds, the Recorder interface, records), never the SQL recorder, store or queries.
PRODUCER_ONLY = {"engine": ("telemetry", ("events.py", "records.py"))}
NO_TORCH = {"dashboard", "attach", "probe"}
ENGINE_NEVER_LOADS = (
    "kvscope.debug",
    "kvscope.telemetry.store",
    "kvscope.telemetry.recorder",
    "kvscope.telemetry.queries",
)


def _module_of_from(node: ast.ImportFrom, alias: ast.alias) -> str:
    """`from kvscope import engine` imports kvscope.engine; `from kvscope import __version__` the root."""
    assert node.module is not None
    if node.module == "kvscope" and ((PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").exists()):
        return f"kvscope.{alias.name}"
    return node.module


def kvscope_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) for every import in a file; a relative
    import reads as module '.'."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, ".", None))
            else:
                found += [(node.lineno, _module_of_from(node, alias), alias.name) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value, None))
    return sorted(found, key=lambda item: item[0])


def defined_names(package: str, files: tuple[str, ...]) -> set[str]:
    """The top-level names the given modules of a kvscope package define."""
    names = set()
    for file in files:
        for node in ast.parse((PACKAGE / package / file).read_text()).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def package_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def violations(package: str, imports: list[tuple[int, str, str | None]]) -> list[str]:
    """`line: module` for every import a module of `package` may not make."""
    bad = []
    only_from, producer_files = PRODUCER_ONLY.get(package, ("", ()))
    producer_names = defined_names(only_from, producer_files) if only_from else set()
    for line, module, name in imports:
        parts = module.split(".")
        if module == ".":
            bad.append(f"{line}: a relative import (write kvscope.<package>)")
        elif parts[0] == "kvscope" and len(parts) > 1 and parts[1] not in ALLOWED[package]:
            bad.append(f"{line}: {module}")
        elif (
            parts[0] == "kvscope"
            and len(parts) > 1
            and parts[1] == only_from
            and (len(parts) > 2 or name not in producer_names)
        ):
            bad.append(
                f"{line}: {module}{f' import {name}' if len(parts) == 2 else ''} (only the producer side "
                f"of the package face kvscope.{only_from})"
            )
        elif package in NO_TORCH and parts[0] == "torch":
            bad.append(f"{line}: torch")
    return bad


def test_layers_import_downward_only() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = package_of(path)
        assert package in ALLOWED, f"new package or top-level module {package!r}: add its allowed imports here"
        found += [f"{path.relative_to(ROOT)}:{v}" for v in violations(package, kvscope_imports(path))]
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_the_engine_loads_neither_the_debugger_nor_the_store() -> None:
    """Every name of the engine's face, loaded in a fresh interpreter, pulls in no debugger
    and no capture reader or writer (the lazy names included)."""
    code = (
        "import sys, kvscope.engine as engine\n"
        "for name in engine.__all__: getattr(engine, name)\n"
        f"print([m for m in sys.modules if m.startswith({ENGINE_NEVER_LOADS!r})])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_probe_loads_nothing_an_engine_venv_lacks() -> None:
    """The probe, its vLLM module and its recorder load in a fresh interpreter without SQLAlchemy,
    pandas, torch or any other kvscope layer: they run in vLLM's venv, which has only numpy."""
    code = (
        "import sys, kvscope.probe, kvscope.probe.vllm, kvscope.telemetry.remote\n"
        "heavy = ('sqlalchemy', 'pandas', 'torch', 'streamlit', 'vllm', 'kvscope.engine', 'kvscope.debug',\n"
        "         'kvscope.telemetry.store', 'kvscope.telemetry.recorder', 'kvscope.telemetry.queries')\n"
        "print(sorted({m for m in sys.modules if m.startswith(heavy)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("package", sorted(NO_TORCH - {"dashboard"}))  # the dashboard: tests/dashboard/test_pages.py
def test_a_package_that_runs_without_torch_never_loads_it(package: str) -> None:
    """Every module of the package, imported in a fresh interpreter, leaves torch unloaded
    (the static check above misses torch pulled in through another layer)."""
    modules = sorted(
        f"kvscope.{package}" + (f".{p.stem}" if p.stem != "__init__" else "") for p in (PACKAGE / package).glob("*.py")
    )
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", f"importing kvscope.{package} loaded torch"


def test_app_imports_only_the_dashboard_side() -> None:
    allowed = ALLOWED["dashboard"]
    bad = [
        f"app.py:{line} imports {module}"
        for line, module, _ in kvscope_imports(ROOT / "app.py")
        if module.split(".")[0] == "torch" or (module.startswith("kvscope.") and module.split(".")[1] not in allowed)
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
    """Guard against a checker that cannot fail: each kind of wrong import is reported."""
    bad = tmp_path / "mod.py"
    bad.write_text(
        "from kvscope.engine import scheduler\nimport torch\nfrom kvscope import debug\n"
        "from kvscope.telemetry.store import CaptureError\nfrom . import sibling\n"
        "import importlib\nimportlib.import_module('kvscope.app')\n"
        "from kvscope.telemetry import EventKind, SQLRecorder\n"
    )
    imports = kvscope_imports(bad)
    assert [m for _, m, _ in imports] == [
        "kvscope.engine",
        "torch",
        "kvscope.debug",
        "kvscope.telemetry.store",
        ".",
        "importlib",
        "kvscope.app",
        "kvscope.telemetry",
        "kvscope.telemetry",
    ]
    assert violations("mem", imports) == [
        "1: kvscope.engine",
        "3: kvscope.debug",
        "5: a relative import (write kvscope.<package>)",
        "7: kvscope.app",
    ]
    producer = "(only the producer side of the package face kvscope.telemetry)"
    assert violations("engine", imports) == [
        "3: kvscope.debug",
        f"4: kvscope.telemetry.store {producer}",
        "5: a relative import (write kvscope.<package>)",
        "7: kvscope.app",
        f"8: kvscope.telemetry import SQLRecorder {producer}",
    ]
    assert "2: torch" in violations("dashboard", imports)
    assert violations("attach", [(1, "kvscope.cache", "RadixCache"), (2, "kvscope.mem", None)]) == [
        "1: kvscope.cache",
        "2: kvscope.mem",
    ]
    assert violations("app", [(1, "kvscope.debug.report", "build_report"), (2, "kvscope.telemetry", "Capture")]) == []
