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

COMMANDS is their order in `kvscope --help`. The contract is base.Command.
"""

from __future__ import annotations

from kvscope.app.commands.attach import AttachCommand
from kvscope.app.commands.base import Command, HelpFormatter, Parser, add_command
from kvscope.app.commands.check import CheckCommand
from kvscope.app.commands.demo import DemoCommand
from kvscope.app.commands.diff import DiffCommand
from kvscope.app.commands.engine_options import POLICY_HELP
from kvscope.app.commands.fleet import FleetCommand
from kvscope.app.commands.instrument import InstrumentCommand
from kvscope.app.commands.load import LoadCommand
from kvscope.app.commands.plan import PlanCommand
from kvscope.app.commands.replay import ReplayCommand
from kvscope.app.commands.report import ReportCommand
from kvscope.app.commands.run import RunCommand
from kvscope.app.commands.runs import RunsCommand
from kvscope.app.commands.serve import ServeCommand
from kvscope.app.commands.upgrade import UpgradeCommand

COMMANDS: tuple[Command, ...] = (
    DemoCommand(),
    RunsCommand(),
    RunCommand(),
    ServeCommand(),
    ReportCommand(),
    CheckCommand(),
    DiffCommand(),
    UpgradeCommand(),
    PlanCommand(),
    ReplayCommand(),
    FleetCommand(),
    LoadCommand(),
    AttachCommand(),
    InstrumentCommand(),
)

__all__ = ["COMMANDS", "POLICY_HELP", "Command", "HelpFormatter", "Parser", "add_command"]
