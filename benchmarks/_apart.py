"""Another version of a probe's modules loaded beside this tree's, each version with its own PROBE (the
A/B benchmarks: bench_probe.py --against, bench_probe_sglang_ab.py)."""

from __future__ import annotations

import sys
from types import ModuleType


def load_apart(sources: dict[str, str], tag: str) -> dict[str, ModuleType]:
    """Each kvscope module of `sources` (name -> its source text, in import order: a module after those it
    imports) loaded as a module of its own, `<name>_<tag>`; while they load, sys.modules names the earlier
    ones in place of this tree's, so the version's modules import each other and this tree's others.
    sys.modules is as before after (but for the new names)."""
    saved = {name: sys.modules.get(name) for name in sources}
    loaded: dict[str, ModuleType] = {}
    try:
        for name, text in sources.items():
            module = sys.modules[f"{name}_{tag}"] = ModuleType(f"{name}_{tag}")
            exec(compile(text, f"{name}@{tag}", "exec"), module.__dict__)
            loaded[name] = sys.modules[name] = module
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
    return loaded
