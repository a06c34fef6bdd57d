"""`kvscope probe-check [--python PATH] [--json]`: its options; the body is kvscope/app/probe_check.py."""

from __future__ import annotations

import argparse


class ProbeCheckCommand:
    name = "probe-check"
    help = "say whether kvscope's probe will load on the engine installed in a python's environment"
    description = (
        "Before starting vLLM or SGLang: asks the engine's python (--python, default this one) which engine "
        "is installed there, its version, and whether its code has the shapes the probe needs. The probe "
        "does not trust version strings: each hooked method is described by its module, its leading "
        "parameters and the attributes the probe reads (a shape), and a family is the shapes of one line of "
        "releases with the releases the tests ran on (docs/probe.md, the version table). A tested release "
        "loads when its code matches its family; an untested one when some family's every shape matches "
        "(said in one line); otherwise nothing is patched and the first differing target is named. Prints "
        "each engine's line, each target's shape with ok or DIFFERS, and what the probe records at each "
        "--level; `kvscope instrument` says the same first line before it starts the engine. Imports the "
        "engine's modules in that python (seconds), never runs them. Exit 0: the probe loads on every "
        "engine found; 1: it would refuse one, or kvscope is not installed beside it; 2: bad input (no such "
        "python, no engine in its environment)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--python", metavar="PATH", help="the engine's python, e.g. VLLM_VENV/bin/python (default this python)"
        )
        parser.add_argument("--json", action="store_true", help="print the findings as JSON (the text's content)")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.probe_check import probe_check_verb

        return probe_check_verb(args)
