"""The x axis of a page's charts over a run: its steps, or the wall-clock time of each step, so a
chart lines up with an incident's time (a log line, an alert). Memory and the Overview offer it;
Requests and Tiers plot wall-clock time already.

NOTE: a usage row's time is the run's clock at its t_mono (timing.Clock); a capture without a
clock (no anchor, no start time) or without t_mono in its rows has no time to show, and the page
says so in one line instead of offering the choice.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import url_state
from kvscope.dashboard.charts.style import WALL_CLOCK
from kvscope.dashboard.timing import Clock, zone_name

STEPS = "step"
TIMES = "wall-clock time"


def with_wall_clock(usage: pd.DataFrame, clock: Clock) -> pd.DataFrame:
    """The rows with their wall-clock time (local datetimes) in the chart builders' time column."""
    return usage.assign(**{WALL_CLOCK: clock.datetimes(usage["t_mono"])})


def has_times(usage: pd.DataFrame, clock: Clock | None) -> bool:
    return (
        clock is not None and "t_mono" in usage and bool(pd.to_numeric(usage["t_mono"], errors="coerce").notna().any())
    )


def pick(usage: pd.DataFrame, clock: Clock | None, key: str) -> tuple[pd.DataFrame, str]:
    """(the rows, the x column for the chart builders): a choice of steps or wall-clock time where the
    capture has times for its steps, else steps and one line saying why. The choice is the URL's `x`."""
    linked = url_state.pending("x")
    if clock is None or not has_times(usage, clock):
        st.caption("This capture has no timestamps for its steps: the x axis is the step.")
        url_state.publish(x=None)
        return usage, STEPS
    if linked is not None:
        st.session_state[key] = TIMES if linked == "time" else STEPS
    axis = st.radio(
        "x axis",
        (STEPS, TIMES),
        horizontal=True,
        key=key,
        help=f"wall-clock time ({zone_name()}): when each step was recorded, to line the chart up with an "
        "incident's time; the hover names the step either way",
    )
    url_state.publish(x="time" if axis == TIMES else None)
    if axis == STEPS:
        return usage, STEPS
    return with_wall_clock(usage, clock), WALL_CLOCK
