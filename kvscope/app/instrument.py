"""`kvscope instrument -- CMD...`: run a real engine with kvscope's probe recording inside it, the
way `opentelemetry-instrument` and `ddtrace-run` do: set the environment, then exec the command.

The probe itself is loaded by the engine (vLLM's `vllm.general_plugins` entry point, SGLang's
`sglang.srt.plugins` one; each needs kvscope installed in the engine's venv: docs/probe.md); this verb
only says where it records.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from kvscope.telemetry import open_writer

PLUGIN_NAME = "kvscope"  # NOTE: the entry-point name in pyproject.toml's vllm.general_plugins


def default_capture(now_s: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now_s))
    return str(Path("runs") / f"{stamp}-instrument.db")


def instrument_env(capture: str, level: str, environ: dict[str, str], python: str) -> dict[str, str]:
    """The command's environment: the capture, the level, and the interpreter of the recorder's host."""
    if "://" not in capture:
        capture = str(Path(capture).resolve())
    plugins = environ.get("VLLM_PLUGINS")
    if plugins is not None and PLUGIN_NAME not in [p.strip() for p in plugins.split(",")]:
        raise ValueError(f"VLLM_PLUGINS={plugins!r} would keep vLLM from loading the probe: add {PLUGIN_NAME} to it")
    sglang_plugins = environ.get("SGLANG_PLUGINS")  # NOTE: SGLang's allowlist; unset or empty loads every plugin
    if sglang_plugins and PLUGIN_NAME not in [p.strip() for p in sglang_plugins.split(",")]:
        raise ValueError(f"SGLANG_PLUGINS={sglang_plugins!r} would keep SGLang from loading the probe: add "
                         f"{PLUGIN_NAME} to it")
    return {**environ, "KVSCOPE_CAPTURE": capture, "KVSCOPE_LEVEL": level, "KVSCOPE_PYTHON": python}


def instrument_verb(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise ValueError("name the engine's command after --, e.g. kvscope instrument -- vllm serve MODEL")
    if shutil.which(command[0]) is None:
        raise ValueError(f"{command[0]}: command not found")
    capture = args.capture or default_capture()
    env = instrument_env(capture, args.level, dict(os.environ), sys.executable)
    writer = open_writer(env["KVSCOPE_CAPTURE"])  # NOTE: a bad path fails here, in one line, not in the engine
    writer.dispose()
    print(f"kvscope instrument: recording into {env['KVSCOPE_CAPTURE']} (level {args.level}); "
          f"then kvscope check {env['KVSCOPE_CAPTURE']}", file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)
    return 0  # pragma: no cover (exec does not return)


def add_instrument_parser(verbs: Any, formatter: type[argparse.HelpFormatter]) -> None:
    instrument = verbs.add_parser(
        "instrument",
        help="run vLLM with kvscope's probe recording its block pool inside the engine",
        description="Set KVSCOPE_CAPTURE, KVSCOPE_LEVEL and KVSCOPE_PYTHON, then exec CMD (as opentelemetry-instrument "
        "does). kvscope must be installed in the engine's venv (pip install --no-deps, docs/probe.md): vLLM then "
        "loads the probe through its vllm.general_plugins entry point in every process; the EngineCore records "
        "every block alloc, touch, cache, free and eviction with its request, and at each busy -> idle edge a "
        "census of every block's references, stored as leak checks: `kvscope check CAPTURE` exits 0 (clean), 1 "
        "(a leak, with the block and the request that last took it) or 3. Supported: vLLM 0.32.0; another "
        "version is refused in one line and vLLM runs unrecorded. Exit 2 on bad input (no command, a bad capture).",
        formatter_class=formatter,
    )
    instrument.add_argument("--capture", metavar="PATH|URL",
                            help="capture file or database URL (default runs/<time>-instrument.db)")
    instrument.add_argument("--level", choices=["summary", "full"], default="full",
                            help="summary: census, usage and requests; full: and every block event")
    instrument.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                            help="the engine's command, e.g. -- vllm serve MODEL")
    instrument.set_defaults(func=instrument_verb)
