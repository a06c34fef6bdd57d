"""`kvscope diff A B`: two captures side by side — usage peaks, hit rates, evictions,
retractions, the last leak-check terms, event counts per kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvscope.telemetry import Capture


def summarize(target: str | Path) -> dict[str, Any]:
    """The metrics of a capture's latest run, by name (all aggregated in SQL)."""
    capture = Capture(target)
    try:
        run_id = capture.latest_run_id()
        if run_id is None:
            raise ValueError(f"{target}: the capture holds no runs")
        usage = capture.usage(run_id, max_points=100_000)
        out: dict[str, Any] = {"run": run_id, "status": capture.runs().iloc[-1].display_status}
        if not usage.empty:
            last = usage.iloc[-1]
            out["peak used tokens (full)"] = int((usage.full_total - usage.full_available - usage.full_evictable).max())
            if usage.swa_total.notna().any():
                out["peak used tokens (swa)"] = int((usage.swa_total - usage.swa_available - usage.swa_evictable).max())
            out["peak running requests"] = int(usage.num_running.max())
            out["hit rate (token-weighted)"] = f"{last.cum_hit_tokens / max(last.cum_prompt_tokens, 1):.1%}"
            out["hit rate (request-weighted)"] = f"{last.cum_hit_requests / max(last.cum_requests, 1):.1%}"
            out["evicted tokens"] = int(last.cum_evicted_tokens)
            out["retractions"] = int(last.cum_retractions)
            out["steps"] = int(last.step)
        checks = capture.leak_checks(run_id)
        out["leak checks failed"] = int((~checks.ok.astype(bool)).sum()) if not checks.empty else 0
        if not checks.empty:
            for row in checks[checks.step == checks.step.max()].itertuples():
                out[f"last check [{row.pool}] avail/evict/prot/uncached"] = (
                    f"{row.available}/{row.evictable}/{row.protected}/{row.uncached} of {row.total}")
        for row in capture.event_counts(run_id).itertuples():
            out[f"events: {row.kind}"] = int(row.count)
        return out
    finally:
        capture.close()


def render_diff(a: str | Path, b: str | Path) -> str:
    left, right = summarize(a), summarize(b)
    keys = list(dict.fromkeys([*left, *right]))
    width = max(len(k) for k in keys)
    lines = [f"{'':<{width}}  {'A':>22}  {'B':>22}  {'B - A':>10}", f"{'':<{width}}  {str(a)[-22:]:>22}  "
             f"{str(b)[-22:]:>22}"]
    for key in keys:
        x, y = left.get(key, "-"), right.get(key, "-")
        delta = f"{y - x:+d}" if isinstance(x, int) and isinstance(y, int) else ""
        lines.append(f"{key:<{width}}  {x!s:>22}  {y!s:>22}  {delta:>10}")
    return "\n".join(lines)
