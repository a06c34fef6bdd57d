"""Wall-clock time and request latency for the pages (pure: no Streamlit, no reads).

A capture stamps its events, samples and requests with the writer's monotonic clock (`t_mono`,
seconds since some boot-time origin): good for durations, meaningless as a time of day. Each
run's config holds the anchor {"clock": {"wall_s", "mono_s"}} taken together at its start, so
wall = wall_s + (t_mono - mono_s). A capture written before the anchor existed falls back to
the run's start (runs.started_at, unix seconds) at its first t_mono.

NOTE: latencies of a request (seconds, from the requests table)
    queue          admit_t - arrive_t         waiting for a slot in the running batch
    first token    first_token_t - arrive_t   time to first token (TTFT)
    end to end     finish_t - arrive_t
A request that never reached a stage (aborted, unfinished, in flight) has no value for it and
is left out of that stage's percentiles, never counted as zero.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from kvscope.telemetry import REQUEST_LATENCIES, Histogram

LATENCIES = REQUEST_LATENCIES  # NOTE: name -> (end, start) moments; the writer's histograms use the same
REQUEST_TIMES = ("arrive_t", "admit_t", "first_token_t", "finish_t")  # NOTE: the moments LATENCIES reads
PERCENTILES = (50, 90, 99)
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
DATETIME_COLUMN_FORMAT = "YYYY-MM-DD HH:mm:ss.SSS"  # NOTE: st.column_config.DatetimeColumn's (moment.js) to the ms
# NOTE: the caches whose last_access_time is a logical counter (an access order), not monotonic seconds
COUNTER_CLOCK_CACHES = ("swa-radix", "scoped-radix")


class Clock(NamedTuple):
    """wall = wall_s + (t_mono - mono_s); `anchored` is False for the started_at fallback."""

    wall_s: float
    mono_s: float
    anchored: bool

    def wall(self, t_mono: Any) -> Any:
        """Unix seconds of a t_mono (a float, or a Series / array elementwise; NaN stays NaN)."""
        return self.wall_s + (t_mono - self.mono_s)

    def stamp(self, t_mono: float | None, with_date: bool = True) -> str:
        """Local time of day of a t_mono, to the millisecond ('–' when unknown)."""
        if t_mono is None or not math.isfinite(float(t_mono)):
            return "–"
        moment = datetime.fromtimestamp(float(self.wall(float(t_mono)))).astimezone()
        text = moment.strftime(TIME_FORMAT if with_date else "%H:%M:%S")
        return f"{text}.{moment.microsecond // 1000:03d}"

    def times_of_day(self, t_mono: pd.Series) -> pd.Series:
        """Local times of day of a t_mono column as text, to the millisecond ('' where missing)."""
        shown = self.datetimes(t_mono)
        return shown.dt.strftime("%H:%M:%S.%f").str[:-3].fillna("")

    def datetimes(self, t_mono: pd.Series) -> pd.Series:
        """Local wall-clock datetimes of a t_mono column (NaT where it is missing)."""
        seconds = self.wall(pd.to_numeric(t_mono, errors="coerce").astype(float))
        return pd.to_datetime(seconds, unit="s", utc=True).dt.tz_convert(local_zone())


def local_zone() -> Any:
    """This machine's time zone (the dashboard shows local time, and says which)."""
    return datetime.now().astimezone().tzinfo


def zone_name() -> str:
    return datetime.now().astimezone().strftime("%Z") or "local time"


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def clock_of(config: dict[str, Any], started_at: Any, first_t_mono: float | None) -> Clock | None:
    """The run's clock: its anchor when the config has a valid one, else started_at at the
    first t_mono; None when neither is known (no times can be shown)."""
    anchor = config.get("clock")
    if isinstance(anchor, dict):
        wall_s, mono_s = _finite(anchor.get("wall_s")), _finite(anchor.get("mono_s"))
        if wall_s is not None and mono_s is not None:
            return Clock(wall_s, mono_s, True)
    start, first = _finite(started_at), _finite(first_t_mono)
    if start is None or first is None:
        return None
    return Clock(start, first, False)


def latencies(requests: pd.DataFrame) -> pd.DataFrame:
    """rid and status (where `requests` has them) and the three latencies in milliseconds (NaN
    where a stage was not reached)."""
    out = requests[[c for c in ("rid", "status") if c in requests]].copy()
    for name, (end, start) in LATENCIES.items():
        delta = pd.to_numeric(requests[end], errors="coerce") - pd.to_numeric(requests[start], errors="coerce")
        out[name] = (delta * 1000.0).where(delta >= 0)
    return out


def latency_percentiles(latency_ms: pd.DataFrame) -> pd.DataFrame:
    """One row per latency: requests measured, p50 / p90 / p99 (ms, linear interpolation) and max."""
    rows = []
    for name in LATENCIES:
        values = latency_ms[name].dropna().to_numpy(dtype=float)
        row: dict[str, Any] = {"latency": name, "requests": len(values)}
        for q in PERCENTILES:
            row[f"p{q} (ms)"] = float(np.percentile(values, q)) if len(values) else math.nan
        row["max (ms)"] = float(values.max()) if len(values) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def histogram_percentiles(histograms: pd.DataFrame) -> pd.DataFrame:
    """latency_percentiles' table, read from the latency histograms a capture keeps (Capture.
    request_latency_histograms: each value within telemetry.MAX_RELATIVE_ERROR; max exact), with a box per
    latency beside it (q1, median, q3, and whiskers at the furthest values within 1.5 IQR: low, high)."""
    rows = []
    for name in LATENCIES:
        part = histograms[histograms["latency"] == name]
        hist = Histogram(
            part["bucket"].to_numpy(),
            part["num_requests"].to_numpy(),
            part["min_ms"].to_numpy(),
            part["max_ms"].to_numpy(),
        )
        row: dict[str, Any] = {"latency": name, "requests": hist.num_values}
        for q in PERCENTILES:
            row[f"p{q} (ms)"] = hist.percentile(q)
        row["max (ms)"] = hist.percentile(100)
        q1, median, q3 = (hist.percentile(q) for q in (25, 50, 75))
        row |= {"q1": q1, "median": median, "q3": q3}
        reach = 1.5 * (q3 - q1)
        row["low"] = hist.lowest_from(q1 - reach) if hist.num_values else math.nan
        row["high"] = hist.highest_to(q3 + reach) if hist.num_values else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def throughput(usage: pd.DataFrame, clock: Clock | None, window_rows: int = 5) -> pd.DataFrame:
    """Per usage row (in step order): wall time (or seconds since the first row without a
    clock), the token hit rate so far, the hit rate over the last `window_rows` rows, and
    prompt / cached tokens per second over that window. From the cumulative columns, so a
    downsampled series (whole recorded rows, each row's time and totals from one step) works."""
    rows = usage.sort_values("step")
    t = pd.to_numeric(rows["t_mono"], errors="coerce").astype(float).reset_index(drop=True)
    prompt = pd.to_numeric(rows["cum_prompt_tokens"], errors="coerce").astype(float).reset_index(drop=True)
    hit = pd.to_numeric(rows["cum_hit_tokens"], errors="coerce").astype(float).reset_index(drop=True)
    lag = min(window_rows, max(len(rows) - 1, 1))
    dt, d_prompt, d_hit = t - t.shift(lag), prompt - prompt.shift(lag), hit - hit.shift(lag)
    seconds = dt.where(dt > 0)
    return pd.DataFrame(
        {
            "step": rows["step"].to_numpy(),
            "time": clock.datetimes(t) if clock is not None else t - t.iloc[0] if len(t) else t,
            "hit rate so far": (hit / prompt.where(prompt > 0)),
            "hit rate (window)": d_hit / d_prompt.where(d_prompt > 0),
            "prompt tokens/s": d_prompt / seconds,
            "cached tokens/s": d_hit / seconds,
        }
    )
