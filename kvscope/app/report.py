"""The verbs that read a capture: `runs`, `report leaks`, `check` and `diff`; and storing the
leak report in the capture when `kvscope run` closes it. `report engine-log` reads an SGLang
server's log instead.

NOTE: exit codes. The reading verbs (`runs`, `report leaks`, `report engine-log`, `diff`) exit 0
once they have read and reported, whatever they found, and 2 on bad input; only `check` gates
(0 clean, 1 leak, 3 inconclusive).

`report leaks`, `check` and `diff` read the report stored when the run closed while it still
describes the run (stored_report: a 100-million-event run's replay takes most of an hour), and
replay the capture afresh otherwise or with `--replay`, with the ledger replay's progress on
stderr; each says which it did. Each verb's `--json` shape is documented in docs/cli.md ("Exit
codes and JSON").

NOTE: none of these load torch (tests/app/test_json_shapes.py runs them and looks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from kvscope.app.progress import Progress
from kvscope.debug import LeakReport, ProgressHook, build_report, render_text, save_report
from kvscope.debug.diff import diff, render_diff
from kvscope.debug.engine_log import read_engine_log
from kvscope.debug.engine_log import render_text as render_engine_log
from kvscope.debug.report import CHECK_EXIT_CODES, REPORT_KIND, Verdict, run_row, stored_report, verdict
from kvscope.telemetry import Capture, CaptureError, display_name
from kvscope.telemetry.retention import OverBound, size_text

PROGRESS_DELAY_S = 1.0  # a replay shorter than this shows no progress


def ledger_progress(progress: Progress) -> ProgressHook:
    """The ledger replay's progress hook: `replaying the slot ledger: 412,000 events, 4 s`."""

    def on_progress(num_events: int) -> None:
        if progress.due():
            progress.draw(f"replaying the slot ledger: {num_events:,} events, {progress.elapsed_s:.0f} s ")

    return on_progress


def replay_report(target: str | Path, run_id: int | None, err: TextIO | None = None) -> LeakReport:
    """The leak report of a run, replayed afresh, with progress on `err`."""
    err = sys.stderr if err is None else err
    progress = Progress(err, delay_s=PROGRESS_DELAY_S)
    try:
        return build_report(target, run_id, on_progress=ledger_progress(progress))
    finally:
        progress.close()


class FoundReport(NamedTuple):
    """A run's leak report and where it came from: "stored" (read back from the capture) or "replayed"."""

    report: LeakReport
    source: str
    why: str  # why it was replayed ("" when stored)


def leak_report(
    target: str | Path, run_id: int | None, *, replay: bool = False, err: TextIO | None = None
) -> FoundReport:
    """The run's leak report: the one stored when it closed while it still describes the run
    (stored_report), else (or with `replay`) replayed afresh."""
    if replay:
        return FoundReport(replay_report(target, run_id, err), "replayed", "--replay")
    capture = Capture(target)
    try:
        number = int(run_row(capture, run_id).id)
        stored = stored_report(capture, number)
        if stored is not None:
            return FoundReport(stored, "stored", "")
        never = capture.stored_report(number, REPORT_KIND) is None
    finally:
        capture.close()
    why = "no report was stored" if never else "the stored one no longer describes the run"
    return FoundReport(replay_report(target, number, err), "replayed", why)


def source_line(found: FoundReport) -> str:
    """Which report a verdict was read from, in one line."""
    if found.source != "stored":
        return f"replayed from the capture's events ({found.why})"
    built = found.report.stored_at
    when = "" if built is None else f", built {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(built))}"
    return f"from the leak report stored when the run closed{when} (--replay replays the events)"


def store_leak_report(target: str | Path, run_id: int, err: TextIO | None = None) -> str:
    """Build the leak report of the run just closed and store it in the capture, so the
    dashboard and `report leaks` need not replay the events again. Returns the verdict line."""
    err = sys.stderr if err is None else err
    try:
        report = replay_report(target, run_id, err)
        save_report(target, report)
    except (CaptureError, ValueError) as exc:
        return f"not stored ({exc})"
    return f"{verdict(report).reason} (stored in the capture)"


# -- runs ------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A numeric cell as a float; None for NULL, NaN, '' or anything else that is not a number."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _text(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)) or str(value) == "":
        return None
    return str(value)


def run_entry(
    row: Any, event_bytes: int | None = None, kept: Any = None, over: OverBound | None = None
) -> dict[str, Any]:
    """One run as `kvscope runs --json` gives it; an empty or malformed field is None. `event_bytes`:
    its kept events' packed bytes; `kept`: its retention row (None: no bound, nothing dropped);
    `over`: the capture is past its size bound (Capture.over_bounds)."""
    started = _number(row.started_at)
    end = _number(row.ended_at)
    end = _number(row.heartbeat_at) if end is None else end
    return {
        **_base_entry(row, started, end),
        "event_bytes": event_bytes,
        "retention": None if kept is None else _retention_entry(kept, over),
    }


def run_retention(target: str, run_id: int) -> dict[str, Any] | None:
    """One run's retention entry (as in `kvscope runs --json`) read from its capture; None when it
    has no bound or the capture cannot be read (the verb that recorded it said why)."""
    try:
        capture = Capture(target)
    except CaptureError:
        return None
    try:
        kept = capture.run_retention(run_id)
        return None if kept is None else _retention_entry(kept, capture.over_bounds().get(run_id))
    except CaptureError:
        return None
    finally:
        capture.close()


def retention_lines(kept: dict[str, Any]) -> list[str]:
    """What a bounded run kept and dropped, and the warning when its bound is not kept."""
    return [_retention_text(kept), *_over_bound_lines(kept)]


def _retention_entry(kept: Any, over: OverBound | None) -> dict[str, Any]:
    """A run's bounds and what it dropped (schema.event_retention); `over_bound`: the capture's
    bytes in use and what is kept for life of them when it is past the size bound, else None."""
    dropped = int(kept.first_seq)
    return {
        "keep_events_s": _number(kept.keep_events_s),
        "max_bytes": None if _number(kept.max_bytes) is None else int(kept.max_bytes),
        "dropped_events": dropped,
        "dropped_bytes": int(kept.dropped_bytes),
        "events_from_step": int(kept.first_step) if dropped else None,
        "over_bound": None
        if over is None
        else {"used_bytes": over.used_bytes, "kept_for_life_bytes": over.kept_for_life_bytes},
    }


def _base_entry(row: Any, started: float | None, end: float | None) -> dict[str, Any]:
    return {
        "id": int(row.id),
        "label": _text(row.label),
        "status": _text(row.display_status),
        "level": _text(row.level),
        "started_at": None if started is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "started_at_unix": started,
        "seconds": None if started is None or end is None else round(end - started, 3),
        "error": _text(row.error),
    }


def runs_verb(args: argparse.Namespace) -> int:
    capture = Capture(args.capture)
    try:
        frame = capture.runs()
        sizes = capture.event_bytes()
        retention = capture.retention()
        over = capture.over_bounds()
    finally:
        capture.close()
    if args.run is not None:
        if args.run not in set(frame.id):
            raise ValueError(f"{capture.name}: no run {args.run} (runs: {', '.join(map(str, frame.id)) or 'none'})")
        frame = frame[frame.id == args.run]
    kept = {int(row.run_id): row for row in retention.itertuples()}
    entries = [
        run_entry(row, sizes.get(int(row.id), 0), kept.get(int(row.id)), over.get(int(row.id)))
        for row in frame.itertuples()
    ]
    if args.json:
        print(json.dumps({"capture": capture.name, "runs": entries}, indent=2))
    elif not entries:
        print(f"{capture.name}: no runs recorded")
    else:
        print("\n".join(runs_table(entries)))
    return 0


def runs_table(entries: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'id':>4}  {'status':<22} {'level':<8} {'started (UTC)':<20} {'seconds':>8} {'events':>9}  label"]
    for run in entries:
        started = "-" if run["started_at"] is None else run["started_at"].replace("T", " ").rstrip("Z")
        seconds = "-" if run["seconds"] is None else f"{run['seconds']:.1f}"
        size = "-" if run.get("event_bytes") is None else size_text(run["event_bytes"])
        lines.append(
            f"{run['id']:>4}  {run['status'] or '-':<22} {run['level'] or '-':<8} {started:<20} "
            f"{seconds:>8} {size:>9}  {run['label'] or '-'}"
        )
        if run["error"]:
            lines.append(f"{'':>6}error: {run['error']}")
        if run.get("retention"):
            lines.append(f"{'':>6}retention: {_retention_text(run['retention'])}")
            lines += [f"{'':>6}{line}" for line in _over_bound_lines(run["retention"])]
    return lines


def _retention_text(kept: dict[str, Any]) -> str:
    bounds = [f"{_seconds_text(kept['keep_events_s'])} of events" if kept["keep_events_s"] else None]
    bounds.append(f"at most {size_text(kept['max_bytes'])}" if kept["max_bytes"] else None)
    keeps = " and ".join(b for b in bounds if b)
    if not kept["dropped_events"]:
        return f"keeps {keeps}; nothing dropped yet"
    return (
        f"keeps {keeps}; events from step {kept['events_from_step']} on ({kept['dropped_events']:,} older "
        f"events, {size_text(kept['dropped_bytes'])}, dropped)"
    )


def _over_bound_lines(kept: dict[str, Any]) -> list[str]:
    over = kept.get("over_bound")
    if not over:
        return []
    text = OverBound(over["used_bytes"], kept["max_bytes"], over["kept_for_life_bytes"]).text()
    return [f"WARNING: the size bound is not kept: {text}"]


def _seconds_text(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale and seconds % scale == 0:
            return f"{int(seconds // scale)}{unit}"
    return f"{seconds:g}s"


# -- report leaks, check, diff ---------------------------------------------------------------


def report_verb(args: argparse.Namespace) -> int:
    found = leak_report(args.capture, args.run, replay=args.replay)
    report = found.report
    if args.json:
        check = verdict(report)
        shape = {**json.loads(report.to_json()), "verdict": check.verdict, "reason": check.reason}
        print(json.dumps({**shape, "source": found.source}, indent=2))
    else:
        header, _, rest = render_text(report).partition("\n")
        print(f"{header}\nreport: {source_line(found)}\n{rest}")
    return 0


def check_verb(args: argparse.Namespace) -> int:
    """Exit 0 clean, 1 leak, 3 inconclusive (2, unreadable, comes from cli.main). The verdict line
    is the one line on stdout; where it was read from goes to stderr."""
    if getattr(args, "fleet", None) is not None:
        return check_fleet(args)
    found = leak_report(args.capture, args.run, replay=args.replay)
    report = found.report
    check = verdict(report)
    if args.json:
        print(
            json.dumps(
                {
                    "capture": report.capture,
                    "run": report.run_id,
                    "status": report.status,
                    "verdict": check.verdict,
                    "exit_code": check.exit_code,
                    "reason": check.reason,
                    "source": found.source,
                },
                indent=2,
            )
        )
    else:
        print(f"{report.capture}: {check.reason}")
        print(f"kvscope check: {source_line(found)}", file=sys.stderr)
    return check.exit_code


# NOTE: a fleet's verdict is its worst replica's: a leak anywhere (1) before an inconclusive one (3) before clean
FLEET_VERDICT_ORDER = (1, 3, 0)


def check_fleet(args: argparse.Namespace) -> int:
    """`check --fleet [ID]`: every replica's verdict, one line each, and the worst as the exit code."""
    from kvscope.fleet.figures import fleets, pick_fleet

    if args.run is not None:
        raise CaptureError("check: --run and --fleet cannot be used together (--fleet checks every replica's run)")
    capture = Capture(args.capture)
    try:
        try:
            fleet = pick_fleet(fleets(capture), args.fleet or None)
        except ValueError as err:
            raise CaptureError(f"{capture.name}: {err}") from None
    finally:
        capture.close()
    checked = []
    sources: list[str] = []  # per replica checked: "stored" or "replayed"
    for replica in fleet.replicas:
        found = leak_report(args.capture, replica.run_id, replay=args.replay)
        sources.append(found.source)
        checked.append((replica, found.report, verdict(found.report)))
    missing = fleet.missing_ranks()  # NOTE: a replica without a run was never checked: inconclusive, never clean
    unseen = Verdict(
        "inconclusive",
        CHECK_EXIT_CODES["inconclusive"],
        f"inconclusive: no run of this replica in the capture (the fleet declares {fleet.size}), "
        "so it was never checked",
    )
    verdicts = [c for _, _, c in checked] + [unseen] * len(missing)
    worst = min(verdicts, key=lambda c: FLEET_VERDICT_ORDER.index(c.exit_code))
    name = display_name(args.capture)
    if args.json:
        rows: list[tuple[int, int | None, str | None, Verdict, str | None]]
        rows = [
            (r.rank, report.run_id, report.status, c, s) for (r, report, c), s in zip(checked, sources, strict=True)
        ]
        rows += [(rank, None, None, unseen, None) for rank in missing]
        replicas = [
            {
                "rank": rank,
                "run": run_id,
                "status": status,
                "verdict": c.verdict,
                "exit_code": c.exit_code,
                "reason": c.reason,
                "source": source,
            }
            for rank, run_id, status, c, source in sorted(rows, key=lambda row: row[0])
        ]
        print(
            json.dumps(
                {
                    "capture": name,
                    "fleet": fleet.id,
                    "verdict": worst.verdict,
                    "exit_code": worst.exit_code,
                    "replicas": replicas,
                },
                indent=2,
            )
        )
    else:
        lines = [(r.rank, f"rank {r.rank} (run {report.run_id}): {c.reason}") for r, report, c in checked]
        lines += [(rank, f"rank {rank}: {unseen.reason}") for rank in missing]
        for _, line in sorted(lines):
            print(f"{name} fleet {fleet.id} {line}")
        of = f" of {fleet.size}" if missing else ""
        print(f"{name} fleet {fleet.id}: {worst.verdict} ({len(checked)} replicas{of})")
        stored = sources.count("stored")
        print(f"kvscope check: {stored} from their stored reports, {len(sources) - stored} replayed", file=sys.stderr)
    return worst.exit_code


def diff_verb(args: argparse.Namespace) -> int:
    runs = args.run or []
    if len(runs) > 2:
        raise ValueError(f"--run given {len(runs)} times: give it once (both captures) or twice (A, then B)")
    run_a, run_b = (runs[0], runs[-1]) if runs else (None, None)
    progress = Progress(sys.stderr, delay_s=PROGRESS_DELAY_S)
    try:
        result = diff(args.a, args.b, run_a, run_b, on_progress=ledger_progress(progress), replay=args.replay)
    finally:
        progress.close()
    print(json.dumps(result, indent=2, default=str) if args.json else render_diff(result))
    return 0


# -- report engine-log -----------------------------------------------------------------------


def engine_log_verb(args: argparse.Namespace) -> int:
    """Exit 0 once the log is read and explained, leak messages or not: a reading verb reports, only
    `check` gates (2, unreadable, comes from cli.main)."""
    report = read_engine_log(args.log)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render_engine_log(report))
    return 0
