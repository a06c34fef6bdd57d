"""`kvscope diff A B`: two runs side by side — their verdicts, usage peaks, hit rates,
evictions, retractions, the last leak-check terms, event counts per kind, and the settings in
which their configs differ.

NOTE: a side (summarize) is a plain dict, printed as it is by `kvscope diff --json`:
    capture, run, status, level   the run
    verdict, reason               kvscope check's verdict (clean / leak / inconclusive) and its line
    source       the leak report it is read from: "stored" (at close) or "replayed" (none stored that
                 still describes the run, or --replay)
    metrics      name -> number (hit rates as fractions of 1), aggregated in SQL
    last_check   pool -> step, total, available, evictable, protected, held, uncached, missing
                 (missing = total - the other terms; negative when tokens are counted twice)
    events       kind -> count (empty below level full)
    config       the run's config flattened to dotted keys (its clock anchor left out)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.debug.replay import ProgressHook
from kvscope.debug.report import build_report, run_row, stored_report, verdict
from kvscope.telemetry import Capture

TERMS = ("available", "evictable", "protected", "held", "uncached")
RATES = ("hit rate (token-weighted)", "hit rate (request-weighted)")
IGNORED_CONFIG = ("clock",)  # differs between any two runs
ALL_ROWS = 10_000_000  # usage rows read for the run's figures: every one


def summarize(
    target: str | Path, run_id: int | None = None, *, on_progress: ProgressHook | None = None, replay: bool = False
) -> dict[str, Any]:
    """One side of a diff: the run (default: the latest) of a capture, by name."""
    capture = Capture(target)
    try:
        run = run_row(capture, run_id)
        number = int(run.id)
        side: dict[str, Any] = {
            "capture": str(target),
            "run": number,
            "status": str(run.display_status),
            "level": str(run.level),
        }
        side["metrics"] = _metrics(capture, number)
        side["last_check"] = _last_check(capture.leak_checks(number))
        side["events"] = {str(row.kind): int(row.count) for row in capture.event_counts(number).itertuples()}
        side["config"] = flatten({k: v for k, v in _config(run.config).items() if k not in IGNORED_CONFIG})
        report = None if replay else stored_report(capture, number)
    finally:
        capture.close()
    check = verdict(report or build_report(target, number, on_progress=on_progress))
    side.update(verdict=check.verdict, reason=check.reason, source="replayed" if report is None else "stored")
    return side


def _metrics(capture: Capture, run_id: int) -> dict[str, int | float]:
    usage = capture.usage(run_id, max_points=ALL_ROWS)
    out: dict[str, int | float] = {}
    if not usage.empty:
        # NOTE: every row, so each column's peak is exact (a downsampled series keeps each bucket's peak
        # rows, not every column's peak); the last row holds the running totals. An attached engine's
        # capture leaves what its source does not provide NULL: such a figure is left out, never read as 0.
        last = usage.iloc[-1]
        figures = {
            "peak used tokens (full)": pd.to_numeric(usage.full_used).max(),
            "peak used tokens (swa)": (usage.swa_total - usage.swa_available - usage.swa_evictable).max(),
            "peak running requests": pd.to_numeric(usage.num_running).max(),
            RATES[0]: _ratio(last.cum_hit_tokens, last.cum_prompt_tokens),
            RATES[1]: _ratio(last.cum_hit_requests, last.cum_requests),
            "evicted tokens": last.cum_evicted_tokens,
            "retractions": last.cum_retractions,
            "steps": last.step,
        }
        for name, value in figures.items():
            if pd.notna(value):
                out[name] = float(value) if name in RATES else int(value)
    checks = capture.leak_checks(run_id)
    out["leak checks"] = int(checks.step.nunique()) if not checks.empty else 0
    out["leak checks failed"] = int(checks[~checks.ok.astype(bool)].step.nunique()) if not checks.empty else 0
    return out


def _ratio(part: Any, whole: Any) -> float | None:
    """part / whole (whole at least 1); None when the capture does not hold either."""
    if pd.isna(part) or pd.isna(whole):
        return None
    return float(part) / max(float(whole), 1.0)


def _last_check(checks: pd.DataFrame) -> dict[str, dict[str, int]]:
    if checks.empty:
        return {}
    last = checks[checks.step == checks.step.max()]
    out = {}
    for row in last.itertuples():
        terms = {name: int(getattr(row, name)) for name in TERMS}
        out[str(row.pool)] = {
            "step": int(row.step),
            "total": int(row.total),
            **terms,
            "missing": int(row.total) - sum(terms.values()),
        }
    return out


def _config(text: Any) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def diff(
    a: str | Path,
    b: str | Path,
    run_a: int | None = None,
    run_b: int | None = None,
    *,
    on_progress: ProgressHook | None = None,
    replay: bool = False,
) -> dict[str, Any]:
    """Both sides, the deltas B - A of what both have, and the config settings that differ. With
    `replay`, each side's verdict comes from a fresh replay, never from a stored report."""
    left = summarize(a, run_a, on_progress=on_progress, replay=replay)
    right = summarize(b, run_b, on_progress=on_progress, replay=replay)
    return {"a": left, "b": right, "deltas": _deltas(left, right), "config_differences": _config_diff(left, right)}


def _deltas(left: dict[str, Any], right: dict[str, Any]) -> dict[str, dict[str, int | float]]:
    metrics = {
        name: _minus(right["metrics"][name], value)
        for name, value in left["metrics"].items()
        if name in right["metrics"]
    }
    missing = {
        pool: right["last_check"][pool]["missing"] - terms["missing"]
        for pool, terms in left["last_check"].items()
        if pool in right["last_check"]
    }
    events: dict[str, int | float] = {}
    if left["level"] == right["level"] == "full":  # below full, no events: absent is not zero
        kinds = dict.fromkeys([*left["events"], *right["events"]])
        events = {kind: right["events"].get(kind, 0) - left["events"].get(kind, 0) for kind in kinds}
    return {"metrics": metrics, "missing": missing, "events": events}


def _minus(b: int | float, a: int | float) -> int | float:
    return round(b - a, 6) if isinstance(a, float) or isinstance(b, float) else b - a


def _config_diff(left: dict[str, Any], right: dict[str, Any]) -> dict[str, dict[str, Any]]:
    keys = dict.fromkeys([*left["config"], *right["config"]])
    return {
        key: {"a": left["config"].get(key), "b": right["config"].get(key)}
        for key in keys
        if left["config"].get(key) != right["config"].get(key)
    }


def render_diff(result: dict[str, Any]) -> str:
    """`diff()`'s result as a table: one row per measure, A, B and B - A."""
    left, right, deltas = result["a"], result["b"], result["deltas"]
    rows: list[tuple[str, str, str, str]] = [
        ("", left["capture"], right["capture"], ""),
        ("run", str(left["run"]), str(right["run"]), ""),
        ("status", left["status"], right["status"], ""),
        ("verdict", left["verdict"], right["verdict"], ""),
        ("leak report", left["source"], right["source"], ""),
    ]
    for name in dict.fromkeys([*left["metrics"], *right["metrics"]]):
        delta = deltas["metrics"].get(name)
        rows.append(
            (
                name,
                _value(name, left["metrics"].get(name)),
                _value(name, right["metrics"].get(name)),
                "" if delta is None else _delta(name, delta),
            )
        )
    for pool in dict.fromkeys([*left["last_check"], *right["last_check"]]):
        delta = deltas["missing"].get(pool)
        rows.append(
            (
                f"last check [{pool}]",
                _terms(left, pool),
                _terms(right, pool),
                "" if delta is None else f"{delta:+d} missing",
            )
        )
    for kind in dict.fromkeys([*left["events"], *right["events"]]):
        delta = deltas["events"].get(kind)
        rows.append(
            (
                f"events: {kind}",
                str(left["events"].get(kind, "-")),
                str(right["events"].get(kind, "-")),
                "" if delta is None else f"{delta:+d}",
            )
        )
    legend = (
        [
            "(last check: available/evictable/protected/held/uncached/missing of total, at the run's last idle "
            "leak check)"
        ]
        if left["last_check"] or right["last_check"]
        else []
    )
    return "\n".join(
        [
            *_table(rows),
            *legend,
            *_config_lines(result["config_differences"]),
            f"verdict A: {left['reason']}",
            f"verdict B: {right['reason']}",
        ]
    )


def _value(name: str, value: int | float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if name in RATES else str(value)


def _delta(name: str, delta: int | float) -> str:
    return f"{delta * 100:+.1f} pp" if name in RATES else f"{delta:+d}" if isinstance(delta, int) else f"{delta:+g}"


def _terms(side: dict[str, Any], pool: str) -> str:
    terms = side["last_check"].get(pool)
    if terms is None:
        return "-"
    return "/".join(str(terms[name]) for name in (*TERMS, "missing")) + f" of {terms['total']}"


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    name_w = max(len(r[0]) for r in rows)
    value_w = max(12, *(len(r[i]) for r in rows[1:] for i in (1, 2)), *(min(len(rows[0][i]), 40) for i in (1, 2)))
    lines = [f"{'':<{name_w}}  {'A':>{value_w}}  {'B':>{value_w}}  {'B - A':>12}"]
    for i, (name, x, y, delta) in enumerate(rows):
        if i == 0:  # the captures' names, cut to the column from the left
            x, y = (v if len(v) <= value_w else f"…{v[1 - value_w :]}" for v in (x, y))
        lines.append(f"{name:<{name_w}}  {x:>{value_w}}  {y:>{value_w}}  {delta:>12}".rstrip())
    return lines


def _config_lines(differences: dict[str, dict[str, Any]]) -> list[str]:
    if not differences:
        return ["config: the same in every setting"]
    lines = [f"config: {len(differences)} setting{'s' if len(differences) != 1 else ''} differ (A -> B)"]
    width = max(len(key) for key in differences)
    for key, pair in differences.items():
        lines.append(f"  {key:<{width}}  {json.dumps(pair['a'])} -> {json.dumps(pair['b'])}")
    return lines
