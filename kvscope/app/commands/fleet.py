"""`kvscope fleet`: its options; the body is kvscope/app/fleet.py."""

from __future__ import annotations

import argparse


class FleetCommand:
    name = "fleet"
    help = "a fleet's replicas side by side, routing loss per dispatch method, duplicated cached tokens"
    description = (
        "Group a capture's runs into fleets (the replicas of one `kvscope serve --dp-size N`, or an instrumented "
        "vLLM's data-parallel ranks) and print one fleet's figures: each replica's usage, hit rate, queue, "
        "evictions, last leak check and idle floor; the routing loss per dispatch method (tokens cached on another "
        "replica but not the chosen one, as a share of prompt tokens); and the fleet's unique vs duplicated cached "
        "tokens (docs/fleet.md)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("capture", help="a capture file (SQLite) or a SQLAlchemy URL")
        parser.add_argument("--fleet", help="the fleet id (default: the capture's latest fleet)")
        parser.add_argument("--json", action="store_true", help="print the figures as JSON (shape: docs/fleet.md)")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.fleet import fleet_verb

        return fleet_verb(args)
