"""The `kvscope` verbs, one module each: its Command holds the verb's options and runs its body.

    demo            demo.py        the pools, slot by slot (body: app/demo.py)
    runs            runs.py        the runs of a capture (app/report.py)
    run             run.py         a workload or trace through the engine into a capture (app/runner.py)
    serve           serve.py       the engine behind an OpenAI-compatible HTTP server (app/serve.py)
    report TOPIC    report.py      leaks of a capture, leak messages of an SGLang log (app/report.py)
    check, diff     check.py, diff.py   a capture's verdict, two runs side by side (app/report.py)
    upgrade         upgrade.py     pack an older capture's events (app/upgrade.py)
    plan, replay    plan.py, replay.py  capacity on a GPU, hit rate vs cache capacity (app/plan.py)
    fleet           fleet.py       a fleet's replicas, routing loss and duplication (app/fleet.py)
    load            load.py        traffic for a server, through the official openai client (app/load.py)
    attach          attach.py      a running server's KV cache into a capture (app/attach.py)
    instrument      instrument.py  a real engine with kvscope's probe inside it (app/instrument.py)
    probe-check     probe_check.py whether the probe will load on an engine's code (app/probe_check.py)

VERBS is their order in `kvscope --help` (COMMANDS: their Commands). The contract is base.Command.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from kvscope.app.commands.base import Command, HelpFormatter, Parser, add_command

# NOTE: verb -> (its module here, its Command), in `kvscope --help` order. A verb's module is imported
# only when its parser is built: `kvscope instrument` builds its own alone (cli.py), so its start
# never loads the other verbs' option types (numpy, the planner's tables)
VERBS = {
    "demo": ("demo", "DemoCommand"),
    "runs": ("runs", "RunsCommand"),
    "run": ("run", "RunCommand"),
    "serve": ("serve", "ServeCommand"),
    "report": ("report", "ReportCommand"),
    "check": ("check", "CheckCommand"),
    "diff": ("diff", "DiffCommand"),
    "upgrade": ("upgrade", "UpgradeCommand"),
    "plan": ("plan", "PlanCommand"),
    "replay": ("replay", "ReplayCommand"),
    "fleet": ("fleet", "FleetCommand"),
    "load": ("load", "LoadCommand"),
    "attach": ("attach", "AttachCommand"),
    "instrument": ("instrument", "InstrumentCommand"),
    "probe-check": ("probe_check", "ProbeCheckCommand"),
}


@cache
def command(verb: str) -> Command:
    """The verb's Command (one per process)."""
    module, name = VERBS[verb]
    made: Command = getattr(importlib.import_module(f"kvscope.app.commands.{module}"), name)()
    return made


def all_commands() -> tuple[Command, ...]:
    return tuple(command(verb) for verb in VERBS)


def __getattr__(name: str) -> Any:
    if name == "COMMANDS":
        return all_commands()
    if name == "POLICY_HELP":
        return importlib.import_module("kvscope.app.commands.engine_options").POLICY_HELP
    raise AttributeError(f"module 'kvscope.app.commands' has no attribute {name!r}")


__all__ = [
    "COMMANDS",
    "POLICY_HELP",
    "VERBS",
    "Command",
    "HelpFormatter",
    "Parser",
    "add_command",
    "all_commands",
    "command",
]
