"""The Fleet page's cached reads (kvscope/fleet/figures.py over the capture's one store): the
fleets and one fleet's figures, keyed by a stamp of the fleet's runs, so a live fleet's figures
follow every rank's flushes, not only the selected run's."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import data
from kvscope.fleet.figures import Fleet, FleetFigures, fleet_figures, fleets


@st.cache_data(ttl=data.LIVE_TTL_S, show_spinner=False)
def fleets_of(path: str) -> list[Fleet]:
    return fleets(data.open_capture(path))


def fleet_stamp(runs: pd.DataFrame, fleet: Fleet) -> float:
    """Moves whenever any of the fleet's runs flushes or ends."""
    ids = {r.run_id for r in fleet.replicas}
    mine = runs[runs["id"].isin(ids)]
    return float(mine["heartbeat_at"].fillna(0).sum() + mine["ended_at"].fillna(0).sum())


def figures_of(path: str, fleet: Fleet, stamp: float) -> FleetFigures:
    return _figures(path, fleet.id, stamp)


@st.cache_data(ttl=data.CACHE_TTL_S, show_spinner=False)
def _figures(path: str, fleet_id: str, stamp: float) -> FleetFigures:
    capture = data.open_capture(path)
    fleet = next(f for f in fleets(capture) if f.id == fleet_id)
    return fleet_figures(capture, fleet)
