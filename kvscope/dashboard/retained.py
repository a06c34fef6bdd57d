"""What retention left of a run, said once where it matters (docs/captures.md, "Retention"): a page
that reads events says in one line which were dropped; the sidebar says when the capture is past the
run's size bound (what is kept for life filled it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import streamlit as st

from kvscope.dashboard import data
from kvscope.telemetry import CaptureError

if TYPE_CHECKING:
    from kvscope.dashboard.frame import Selection


def _retained(chosen: Selection) -> data.Retained | None:
    try:
        return data.retained(chosen.path, chosen.run_id, chosen.stamp)
    except CaptureError:
        return None  # NOTE: a damaged capture: the page's own reads say so


def dropped_line(chosen: Selection) -> None:
    """One line under a page's header when the run's oldest events were dropped."""
    kept = _retained(chosen)
    if kept is not None and kept.first_step is not None:
        st.caption(
            f"Events before step {kept.first_step:,} ({kept.dropped_events:,} events) were dropped by retention: "
            "what this page reads from events starts there; leak checks, requests and usage are kept for the "
            "whole run."
        )


def over_bound_line(chosen: Selection) -> None:
    """The sidebar's warning when the capture is past the run's size bound."""
    kept = _retained(chosen)
    if kept is not None and kept.over_bound is not None:
        st.sidebar.warning(f"The size bound is not kept: {kept.over_bound}.")
