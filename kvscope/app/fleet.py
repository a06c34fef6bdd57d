"""`kvscope fleet CAPTURE|URL [--fleet ID] [--json]`: a fleet's figures (kvscope/fleet/figures.py)
as a table or JSON. A capture with no fleet says so and lists its runs; bad input is one line."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvscope.fleet.figures import FleetFigures, figures_json, fleet_figures, fleets, loose_runs, pick_fleet
from kvscope.telemetry import Capture, display_name

REPLICA_HEADER = (
    f"{'rank':>4} {'run':>4}  {'status':<12} {'usage':>6} {'hit':>6} {'run/wait':>9} {'evicted':>8} {'floor':>7}"
    "  leak check"
)


def fleet_verb(args: argparse.Namespace) -> int:
    capture = Capture(args.capture)
    try:
        found = fleets(capture)
        if not found and args.fleet is None:
            return _no_fleet(args, loose_runs(capture, found))
        figures = fleet_figures(capture, pick_fleet(found, args.fleet))
        others = [f.id for f in found if f.id != figures.fleet.id]
        loose = loose_runs(capture, found)
    finally:
        capture.close()
    if args.json:
        shown = {"capture": display_name(args.capture), **figures_json(figures), "other_fleets": others}
        print(json.dumps({**shown, "runs_in_no_fleet": loose}, indent=2))
    else:
        print("\n".join(fleet_lines(figures, others, loose)))
    return 0


def _no_fleet(args: argparse.Namespace, runs: list[int]) -> int:
    line = f"{display_name(args.capture)}: no fleet (no run carries fleet keys or a vLLM data-parallel rank); runs: "
    line += ", ".join(map(str, runs)) or "none"
    if args.json:
        print(
            json.dumps({"capture": display_name(args.capture), "fleet": None, "runs": runs, "notes": [line]}, indent=2)
        )
    else:
        print(line)
    return 1


def fleet_lines(figures: FleetFigures, others: list[str], loose: list[int] | None = None) -> list[str]:
    fleet = figures.fleet
    size = "" if fleet.size is None else f" of {fleet.size}"
    lines = [f"fleet {fleet.id} ({fleet.source}): {len(fleet.replicas)} replicas{size}"]
    lines += ["", REPLICA_HEADER]
    for row in figures.replicas.to_dict("records"):
        lines.append(
            f"{row['rank']:>4} {row['run_id']:>4}  {row['status']:<12} "
            f"{_pct(row['usage']):>6} {_pct(row['hit_rate']):>6} "
            f"{_pair(row['running'], row['waiting']):>9} {_int(row['evicted_tokens']):>8} "
            f"{_int(row['idle_floor_tokens']):>7}  {row['leak_check']}"
        )
    if not figures.routing.empty:
        lines += ["", f"{'dispatch':<16} {'requests':>8} {'prompt tok':>11} {'lost tok':>9} {'loss':>6}"]
        for row in figures.routing.to_dict("records"):
            lines.append(
                f"{row['dispatch']:<16} {row['num_requests']:>8} {row['prompt_tokens']:>11} "
                f"{row['loss_tokens']:>9} {_pct(row['loss_share']):>6}"
            )
    if not figures.duplication.empty:
        last = figures.duplication.iloc[-1]
        share = last["duplicated_tokens"] / last["held_tokens"] if last["held_tokens"] else 0.0
        lines += [
            "",
            f"cached tokens (latest): held {int(last['held_tokens'])}, unique {int(last['unique_tokens'])}, "
            f"duplicated {int(last['duplicated_tokens'])} ({_pct(share)}); not hashed {int(last['unknown_tokens'])}",
        ]
    lines += ["", *figures.notes] if figures.notes else []
    if others:
        lines.append(f"other fleets in this capture: {', '.join(others)} (--fleet ID)")
    if loose:
        lines.append(f"runs in no fleet: {', '.join(map(str, loose))} (kvscope check CAPTURE --run ID)")
    return lines


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"


def _int(value: Any) -> str:
    return "-" if value is None else str(int(value))


def _pair(a: Any, b: Any) -> str:
    return f"{_int(a)}/{_int(b)}"
