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
NOTE: its start is the engine's: it imports no numpy, pandas or SQLAlchemy (cli.py parses this verb
alone). The recorder's python (KVSCOPE_PYTHON as set, else this one) is asked whether it has kvscope's
dependencies without importing them; a new capture file's directory is checked here, an existing capture
or a database URL by that python, as the recorder's host will open it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import kvscope
from kvscope.probe.core import LEVELS, settings_from_env

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


# NOTE: what the recorder's host imports beside kvscope (kvscope/telemetry/remote.py: SQLRecorder, the store)
HOST_DEPENDENCIES = ("sqlalchemy", "numpy")
CHECK_TIMEOUT_S = 120.0
# NOTE: run by the recorder's interpreter: the capture opened as its host will open it, then its name as
# messages show it (a URL without its password); a bad one prints its one line and exits 2
CHECK_CAPTURE = (
    "import sys\n"
    "from kvscope.telemetry.store import CaptureError, display_name, open_writer\n"
    "try:\n"
    "    open_writer(sys.argv[1]).dispose()\n"
    "except (CaptureError, OSError, ValueError) as err:\n"
    "    print(str(err).splitlines()[0] if str(err) else type(err).__name__)\n"
    "    sys.exit(2)\n"
    "print(display_name(sys.argv[1]))\n"
)
FIND_SPECS = "import importlib.util as u, sys\nprint(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))\n"


def default_capture(now_s: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now_s))
    return str(Path("runs") / f"{stamp}-instrument.db")


def instrument_env(capture: str, level: str | None, environ: dict[str, str], python: str) -> dict[str, str]:
    """The command's environment: the capture, the level (None: KVSCOPE_LEVEL as the environment has it,
    unset: the engine's default), and the interpreter of the recorder's host."""
    if "://" not in capture:
        capture = str(Path(capture).resolve())
    env = {**environ, "KVSCOPE_CAPTURE": capture, "KVSCOPE_PYTHON": python}
    if level is not None:
        env["KVSCOPE_LEVEL"] = level
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


def missing_dependencies(python: str) -> list[str]:
    """HOST_DEPENDENCIES that `python` cannot import (asked without importing them)."""
    if python == sys.executable:
        return [name for name in HOST_DEPENDENCIES if importlib.util.find_spec(name) is None]
    try:
        out = subprocess.run(
            [python, "-c", FIND_SPECS, *HOST_DEPENDENCIES], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"KVSCOPE_PYTHON={python}: cannot run it ({err})") from err
    if out.returncode != 0:
        raise ValueError(f"KVSCOPE_PYTHON={python}: not a working python (exit {out.returncode})")
    return out.stdout.split()


def recorder_python(environ: dict[str, str]) -> str:
    """The interpreter of the recorder's host: KVSCOPE_PYTHON when set, else this one; either must
    have kvscope's dependencies (a kvscope installed with --no-deps beside an engine has not)."""
    python = environ.get("KVSCOPE_PYTHON") or sys.executable
    missing = missing_dependencies(python)
    if missing:
        where = "KVSCOPE_PYTHON" if environ.get("KVSCOPE_PYTHON") else "this python"
        raise ValueError(
            f"{where} ({python}) has no {', '.join(missing)}, which the probe's recorder needs: set KVSCOPE_PYTHON "
            "to the python of a venv where kvscope is installed with its dependencies, or run that venv's "
            "kvscope instrument (the engine's venv needs kvscope only with --no-deps: docs/probe.md)"
        )
    return python


def package_env(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with this kvscope first on PYTHONPATH (as the recorder's host is started)."""
    root = str(Path(kvscope.__file__).resolve().parent.parent)
    path = environ.get("PYTHONPATH")
    return {**environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


def check_capture(capture: str, python: str, environ: dict[str, str]) -> str:
    """Refuses a capture the recorder could not write, in one line, before the engine starts; its name
    as messages show it. A new file's directory is checked here; an existing capture or a database
    (its schema, its server) by `python`, as the recorder's host will open it."""
    path = Path(capture)
    if "://" not in capture and not path.is_dir() and (not path.exists() or path.stat().st_size == 0):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"{capture}: cannot create its directory ({err.strerror})") from err
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise ValueError(f"{capture}: its directory is not writable")
        return capture
    return answer_of(python, ["-c", CHECK_CAPTURE, capture], environ, CHECK_TIMEOUT_S)


def answer_of(python: str, argv: list[str], environ: dict[str, str], timeout_s: float) -> str:
    """Runs `python argv...` with this kvscope first on its path and returns the last line it printed;
    a python that cannot run, fails or prints nothing is a ValueError in one line (its own last line)."""
    try:
        out = subprocess.run(
            [python, *argv], capture_output=True, text=True, env=package_env(environ), timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"{python}: cannot run it ({err})") from err
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        said = lines[-1] if lines else (out.stderr.strip().splitlines() or ["no answer"])[-1]
        raise ValueError(said if out.returncode == 0 or lines else f"{python} exited {out.returncode}: {said}")
    return lines[-1]


def say_probe_check(python: str, env: dict[str, str]) -> None:
    """`kvscope probe-check`'s first line for each engine the command's python has, before the engine
    starts (the probe says it again as it loads); a check that cannot run is said and the engine starts."""
    from kvscope.app.probe_check import ask, load_line

    try:
        lines = [load_line(engine) for engine in ask(python, env)]
    except ValueError as err:
        lines = [f"the probe check did not run: {err}"]
    for line in lines:
        print(f"kvscope instrument: {line}", file=sys.stderr, flush=True)


def instrument_verb(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise ValueError("name the engine's command after --, e.g. kvscope instrument -- vllm serve MODEL")
    if shutil.which(command[0]) is None:
        raise ValueError(f"{command[0]}: command not found")
    capture = args.capture or default_capture()
    chosen = {name: value for name, value in vars(args).items() if name.startswith("KVSCOPE_") and value is not None}
    env = instrument_env(capture, args.level, {**os.environ, **chosen}, recorder_python(dict(os.environ)))
    # NOTE: a bad KVSCOPE_CENSUS_* or LINGER_* bound fails here, not in the engine (the bounds are the same for
    # either engine; the level is not checked here)
    settings_from_env(env, engine="vllm")
    level = env.get("KVSCOPE_LEVEL", "").strip()
    if level and level not in LEVELS:  # NOTE: the environment's, kept without --level: the probe would refuse it
        raise ValueError(f"KVSCOPE_LEVEL must be summary or full, got {level!r}")
    python = engine_python(command)
    known = None if python is None or "VLLM_PLUGINS" in env else engine_plugins(python, env)
    plugins = with_plugins(env.get("VLLM_PLUGINS"), known)
    # NOTE: a bad capture fails here, in one line, not in the engine
    shown = check_capture(env["KVSCOPE_CAPTURE"], env["KVSCOPE_PYTHON"], env)
    if python is not None and args.probe_check:
        say_probe_check(python, env)
    if plugins is None:
        route = "VLLM_PLUGINS unset: GET /kvscope/census is off (set VLLM_PLUGINS to your plugins and kvscope)"
    else:
        env["VLLM_PLUGINS"] = plugins
        route = f"VLLM_PLUGINS={plugins}"
    print(
        f"kvscope instrument: recording into {shown} (level {level or 'full on vLLM, summary on SGLang'}; {route}); "
        f"then kvscope check {shown}",
        file=sys.stderr,
        flush=True,
    )
    os.execvpe(command[0], command, env)
    return 0  # pragma: no cover (exec does not return)
