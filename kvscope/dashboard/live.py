"""A page's live panel: a fragment that reruns about every second while the run is running
(the refresh toggle on), each time with the run's row read again, so the page follows what the
run has flushed since the page opened (a fragment rerun does not rerun app.py's frame, whose
selection and stamp stay as they were).

NOTE: the Overview's live panel does the same by hand (its own, older code)."""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from kvscope.dashboard import data
from kvscope.dashboard.frame import Selection, selection
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
        try:
            panel(now)
        except CaptureError as err:  # NOTE: as app.py shows it: a fragment's exception never reaches app.py
            st.error(str(err))
            return
        if now.live:
            st.caption(f"run {now.run_id} · **{now.status}** · this page refreshes every second")
        elif live:
            st.caption("runs of this page still running · this page refreshes every second")

    live_panel.__qualname__ = f"{__name__}.{name}"
    st.fragment(live_panel, run_every=LIVE_EVERY_S if live else None)()
