"""`kvscope probe-check [--python PATH] [--json]`: before starting an engine, whether kvscope's probe
will load in its environment. The engine's python (this one by default) runs kvscope.probe.check with
this kvscope first on its path: for each engine installed there, its version, the shapes family its
code matches (kvscope/probe/shapes.py) with each target's shape and match, and what the probe records.

NOTE: light, as `kvscope instrument` (which says the same one line, `load_line`): it imports no numpy,
pandas or SQLAlchemy; the engine's modules are imported only by the engine's python.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from kvscope.app.instrument import answer_of

CHECK_TIMEOUT_S = 300.0  # NOTE: importing an engine's modules takes seconds to tens of seconds on a busy machine
LEVELS = {
    "full": "every block or page event, the census, usage, requests, tree snapshots",
    "summary": "the census, usage, requests, tree snapshots",
}


def ask(python: str, environ: dict[str, str]) -> list[dict[str, Any]]:
    """What `python`'s environment answers (kvscope.probe.check); ValueError in one line when it cannot."""
    if shutil.which(python) is None:
        raise ValueError(f"{python}: no such python")
    try:
        found = json.loads(answer_of(python, ["-m", "kvscope.probe.check"], environ, CHECK_TIMEOUT_S))
    except ValueError as err:
        raise ValueError(f"the probe check failed: {err}") from err
    if not isinstance(found, list):
        raise ValueError(f"{python}: the probe check failed: its answer is not a list of engines")
    return found


def load_line(engine: dict[str, Any]) -> str:
    """One line: will the probe load on this engine, with which family."""
    name = f"{engine['engine']} {engine['version']}"
    if not engine["plugin_installed"]:
        return f"{name}: kvscope is not installed beside it (pip install --no-deps, docs/probe.md): no probe will load"
    if engine["loads"] is None:
        return str(engine["line"])
    if not engine["loads"]:
        return f"{engine['line']} (the engine runs unrecorded)"
    tested = "tested" if engine.get("tested") else "not tested"
    return f"{name}: the probe loads with family {engine['family']} ({tested}; {len(engine['targets'])} shapes match)"


def render(engines: list[dict[str, Any]], python: str) -> str:
    lines = []
    for engine in engines:
        lines.append(load_line(engine))
        if engine["line"] and engine["loads"]:
            lines.append(f"  {engine['line']}")
        families = ", ".join(f"{f['name']} ({', '.join(f['releases'])})" for f in engine.get("families", ()))
        if families:
            lines.append(f"  families known (newest first; tested releases): {families}")
        shown = engine["family"] or "the nearest family"
        lines.append(f"  targets of {shown}:" if engine["targets"] else "  no targets to show")
        for target in engine["targets"]:
            params = f"({', '.join(target['params'])}, ...)" if target["params"] else ""
            reads = f" reads {', '.join(target['reads'])}" if target["reads"] else ""
            mark = "ok     " if target["match"] else "DIFFERS"
            lines.append(f"    {mark} {target['target']}{params}{reads}")
            if not target["match"]:
                lines.append(f"            {target['why']}")
        if engine["loads"] and engine["plugin_installed"]:
            lines.append(f"  records ({', '.join(engine['records'])}):")
            default = engine.get("default_level")  # NOTE: absent from an older kvscope beside the engine
            lines.extend(
                f"    --level {level}{' (the default)' if level == default else ''}: {what}"
                for level, what in LEVELS.items()
            )
    return "\n".join(lines)


def probe_check_verb(args: argparse.Namespace) -> int:
    """0: the probe loads on every engine found (or decides at load: no families); 1: it would refuse one,
    or is not installed beside it."""
    python = args.python or sys.executable
    engines = ask(python, dict(os.environ))
    if not engines:
        raise ValueError(f"{python}: neither vLLM nor SGLang is installed in its environment")
    if args.json:
        print(json.dumps({"python": python, "engines": engines}, indent=2))
    else:
        print(render(engines, python))
    return 1 if any(e["loads"] is False or not e["plugin_installed"] for e in engines) else 0
