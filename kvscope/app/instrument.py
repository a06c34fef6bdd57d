"""`kvscope instrument -- CMD...`: run a real engine with kvscope's probe recording inside it, the
way `opentelemetry-instrument` and `ddtrace-run` do: set the environment, then exec the command.

The probe itself is loaded by the engine (vLLM's `vllm.general_plugins` entry point, SGLang's
`sglang.srt.plugins` one; each needs kvscope installed in the engine's venv: docs/probe.md); this verb
says where it records and makes VLLM_PLUGINS name kvscope, since vLLM loads the `GET /kvscope/census`
route (an endpoint plugin) only when that allowlist names it (vllm/plugins/__init__.py, load_endpoint_plugins).

NOTE: VLLM_PLUGINS (vLLM splits it on "," and loads a plugin of any group only if its name is listed)
    set, without kvscope   kvscope is appended: the user's plugins stay, the probe and its route load
    unset                  every general plugin loads, endpoint plugins none: the verb lists the
                           engine's own plugins (entry points of every vllm.* group but endpoints, read
                           by the command's interpreter: a python, or a script's #! python) and sets
                           VLLM_PLUGINS to them plus kvscope, so nothing vLLM loaded before is dropped.
                           A command whose interpreter it cannot tell (a binary, `env python`, docker)
                           keeps it unset: the probe records, the route is off (the line says so).
NOTE: SGLANG_PLUGINS (SGLang strips the names; unset or empty loads every plugin): a list without kvscope
    gets kvscope appended, as VLLM_PLUGINS does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvscope.telemetry import display_name, open_writer

PLUGIN_NAME = "kvscope"  # NOTE: the entry-point name in pyproject.toml's vllm.general_plugins
LIST_PLUGINS_TIMEOUT_S = 60.0
# NOTE: run by the engine's interpreter: its vllm.* plugins that load while VLLM_PLUGINS is unset, and
# whether kvscope's general plugin is installed there
LIST_PLUGINS = (
    "import importlib.metadata as m, json\n"
    "points = [(e.group, e.name) for d in m.distributions() for e in d.entry_points]\n"
    "names = sorted({n for g, n in points if g.startswith('vllm.') and g != 'vllm.endpoint_plugins'})\n"
    "print(json.dumps({'names': names, 'kvscope': ('vllm.general_plugins', 'kvscope') in points}))\n"
)


def default_capture(now_s: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now_s))
    return str(Path("runs") / f"{stamp}-instrument.db")


def instrument_env(capture: str, level: str, environ: dict[str, str], python: str) -> dict[str, str]:
    """The command's environment: the capture, the level, and the interpreter of the recorder's host."""
    if "://" not in capture:
        capture = str(Path(capture).resolve())
    env = {**environ, "KVSCOPE_CAPTURE": capture, "KVSCOPE_LEVEL": level, "KVSCOPE_PYTHON": python}
    sglang_plugins = environ.get("SGLANG_PLUGINS")  # NOTE: SGLang's allowlist; unset or empty loads every plugin
    if sglang_plugins and PLUGIN_NAME not in [p.strip() for p in sglang_plugins.split(",")]:
        env["SGLANG_PLUGINS"] = f"{sglang_plugins},{PLUGIN_NAME}"  # as VLLM_PLUGINS: the user's plugins stay
    return env


def with_plugins(plugins: str | None, engine_plugins: list[str] | None) -> str | None:
    """VLLM_PLUGINS for the command: the user's list with kvscope appended; when unset, the engine's
    own plugins (`engine_plugins`, None: not known) and kvscope; None keeps it unset."""
    if plugins is not None:
        names = plugins.split(",")  # NOTE: exactly as vLLM's envs.py splits it (no strip)
        if PLUGIN_NAME in names:
            return plugins
        return PLUGIN_NAME if plugins == "" else f"{plugins},{PLUGIN_NAME}"
    if engine_plugins is None:
        return None
    return ",".join(sorted({*engine_plugins, PLUGIN_NAME}))


def engine_python(command: list[str]) -> str | None:
    """The interpreter the command runs in: the command itself when it is a python, else the python
    of a script's #! line; None when it cannot tell."""
    path = shutil.which(command[0])
    if path is None:
        return None
    if Path(path).name.startswith("python"):
        return path
    try:
        with open(path, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    parts = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if len(parts) == 1 and Path(parts[0]).name.startswith("python") and Path(parts[0]).is_absolute():
        return parts[0]
    return None


def engine_plugins(python: str, environ: dict[str, str]) -> list[str] | None:
    """The vllm.* plugins `python`'s environment loads while VLLM_PLUGINS is unset; None when it
    cannot be asked. Raises ValueError when kvscope's plugin is not installed there."""
    try:
        out = subprocess.run(
            [python, "-c", LIST_PLUGINS],
            capture_output=True,
            text=True,
            env=environ,
            timeout=LIST_PLUGINS_TIMEOUT_S,
            check=False,
        )
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        found = None
    if found is None:
        return None
    if not found["kvscope"]:
        raise ValueError(
            f"kvscope is not installed beside the engine ({python}): vLLM would not load the probe; "
            f"install it there with pip install --no-deps (docs/probe.md)"
        )
    return [str(name) for name in found["names"]]


def instrument_verb(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise ValueError("name the engine's command after --, e.g. kvscope instrument -- vllm serve MODEL")
    if shutil.which(command[0]) is None:
        raise ValueError(f"{command[0]}: command not found")
    capture = args.capture or default_capture()
    env = instrument_env(capture, args.level, dict(os.environ), sys.executable)
    python = None if "VLLM_PLUGINS" in env else engine_python(command)
    plugins = with_plugins(env.get("VLLM_PLUGINS"), None if python is None else engine_plugins(python, env))
    writer = open_writer(env["KVSCOPE_CAPTURE"])  # NOTE: a bad path fails here, in one line, not in the engine
    writer.dispose()
    if plugins is None:
        route = "VLLM_PLUGINS unset: GET /kvscope/census is off (set VLLM_PLUGINS to your plugins and kvscope)"
    else:
        env["VLLM_PLUGINS"] = plugins
        route = f"VLLM_PLUGINS={plugins}"
    shown = display_name(env["KVSCOPE_CAPTURE"])  # NOTE: a URL without its password
    print(
        f"kvscope instrument: recording into {shown} (level {args.level}; {route}); then kvscope check {shown}",
        file=sys.stderr,
        flush=True,
    )
    os.execvpe(command[0], command, env)
    return 0  # pragma: no cover (exec does not return)
