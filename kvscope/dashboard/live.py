"""A page's live panel: a fragment that reruns about every second while the run is running
(the refresh toggle on), each time with the run's row read again, so the page follows what the
run has flushed since the page opened (a fragment rerun does not rerun app.py's frame, whose
selection and stamp stay as they were).

NOTE: the Overview's and the Tiers page's live panels do the same by hand (their own, older code), through
fragment(): every fragment shows a damaged capture it meets as app.py does, in one line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import plotly.graph_objects as go
import streamlit as st

from kvscope.dashboard import charts, data, x_axis
from kvscope.dashboard.frame import Selection, selection
from kvscope.dashboard.timing import Clock
from kvscope.telemetry import CaptureError

LIVE_EVERY_S = 1.0


def refreshed(chosen: Selection) -> Selection:
    """`chosen` with the run's row, status and stamp read again (the run list is cached for
    data.LIVE_TTL_S); a run that ended while it was followed reruns the whole app once, which
    stops the refreshing."""
    fresh = data.runs(chosen.path)
    rows = fresh[fresh["id"] == chosen.run_id]
    if rows.empty:
        return chosen
    run = rows.iloc[0]
    status = str(run["display_status"])
    if chosen.live and status != "running":
        st.rerun()
    stamp = float(run["heartbeat_at"] or 0.0) + float(run["ended_at"] or 0.0)
    return chosen._replace(run=run, stamp=stamp, status=status)


@contextmanager
def damage_shown() -> Iterator[None]:
    """A CaptureError met inside is the page's one error line. NOTE: a fragment's own reruns happen
    outside app.py's handler, so each fragment's body runs under this."""
    try:
        yield
    except CaptureError as err:
        st.error(str(err))


def fragment(body: Callable[[], None], live: bool) -> None:
    """Run `body` as a fragment (again about every second when `live`), a damaged capture one line."""

    def guarded() -> None:
        with damage_shown():
            body()

    guarded.__qualname__ = f"{body.__module__}.{body.__qualname__}"
    st.fragment(guarded, run_every=LIVE_EVERY_S if live else None)()


def follow(panel: Callable[[Selection], None], name: str, live_with: Callable[[Selection], bool] | None = None) -> None:
    """Run `panel` with the freshest selection: once, or (a live run) again about every second.
    `name` tells the page's fragments apart. `live_with(chosen)`: the page also follows other runs
    (the Fleet page: any replica of the selected run's fleet still running), with the refresh on."""
    chosen = selection()
    live = chosen.live or (
        live_with is not None and bool(st.session_state.get("kvscope.refresh", True)) and live_with(chosen)
    )

    def live_panel() -> None:
        now = refreshed(selection())
        panel(now)
        if now.live:
            st.caption(f"run {now.run_id} · **{now.status}** · this page refreshes every second")
        elif live:
            st.caption("runs of this page still running · this page refreshes every second")

    live_panel.__qualname__ = name
    fragment(live_panel, live)


@st.cache_resource(ttl=data.CACHE_TTL_S, max_entries=32, show_spinner=False)
def usage_chart(path: str, run_id: int, stamp: float, x: str, clock: Clock | None) -> go.Figure:
    """The live usage chart (charts.live_usage_figure, over x_axis.pick's `x`) at one read stamp,
    built once for every session that shows it.

    NOTE: a resource, not cache_data: the sessions share the one figure, which st.plotly_chart only
    reads (it copies it to a dict), where cache_data would unpickle a copy for each. Building it costs
    about 34 ms of CPU for a 560-point chart, which every session paid at every refresh."""
    usage = data.usage(path, run_id, stamp)
    shown = usage if x == x_axis.STEPS or clock is None else x_axis.with_wall_clock(usage, clock)
    return charts.live_usage_figure(shown, x)
