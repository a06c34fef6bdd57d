"""Fleet: the replicas of one fleet side by side (a `kvscope serve --dp-size N`, or an instrumented
vLLM's data-parallel ranks, in one capture), the fleet's unique vs duplicated cached tokens, and
what routing cost in cache hits per dispatch method. Live. It shows what the capture provides and
says in one line what it cannot (docs/fleet.md)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import capability, data, fleets, live
from kvscope.dashboard.charts.fleet import duplication_figure, idle_floor_figure, routing_figure
from kvscope.dashboard.frame import Selection, selection
from kvscope.fleet.figures import Fleet

FLEET_KEY = "fleet.id"
REPLICA_COLUMNS = {
    "rank": st.column_config.NumberColumn("rank", width=45),
    "run_id": st.column_config.NumberColumn("run", width=45),
    "status": st.column_config.TextColumn("status", width=90),
    "usage": st.column_config.ProgressColumn("usage", min_value=0.0, max_value=1.0, format="percent", width=90),
    "hit_rate": st.column_config.NumberColumn("hit rate", format="percent", width=70),
    "running": st.column_config.NumberColumn("running", width=60),
    "waiting": st.column_config.NumberColumn("waiting", width=60),
    "evicted_tokens": st.column_config.NumberColumn("evicted", width=70, help="evicted tokens"),
    "idle_floor_tokens": st.column_config.NumberColumn(
        "idle floor", width=70, help="tokens in use at the last idle check"
    ),
    "leak_check": st.column_config.TextColumn("last leak check", width=260),
}


ROUTING_COLUMNS = {
    "dispatch": st.column_config.TextColumn("dispatch"),
    "num_requests": st.column_config.NumberColumn("requests"),
    "prompt_tokens": st.column_config.NumberColumn("prompt tokens"),
    "loss_tokens": st.column_config.NumberColumn("lost tokens", help="prompt tokens another replica had cached"),
    "loss_share": st.column_config.NumberColumn("loss", format="%.2f%%", help="lost / prompt tokens"),
}


def pick(found: list[Fleet], run_id: int) -> Fleet:
    """The fleet of the selected run, else the latest; a picker when there are several."""
    default = next((f for f in found if any(r.run_id == run_id for r in f.replicas)), found[-1])
    if len(found) == 1:
        return default
    ids = [f.id for f in found]
    chosen = st.selectbox("fleet", ids, index=ids.index(default.id), key=FLEET_KEY)
    return found[ids.index(chosen)]


def panel(chosen: Selection) -> None:
    found = fleets.fleets_of(chosen.path)
    if not found:
        st.info(
            "No fleet in this capture: no run carries fleet keys (`kvscope serve --dp-size N`) or a vLLM "
            "data-parallel rank. Each run's own pages show it alone."
        )
        return
    fleet = pick(found, chosen.run_id)
    figures = fleets.figures_of(chosen.path, fleet, fleets.fleet_stamp(data.runs(chosen.path), fleet))
    size = "" if fleet.size is None else f" of {fleet.size}"
    st.caption(f"fleet **{fleet.id}** ({fleet.source}): {len(fleet.replicas)} replicas{size}")
    st.subheader("Replicas")
    st.dataframe(figures.replicas, column_config=REPLICA_COLUMNS, hide_index=True)
    duplication_section(figures.duplication)
    routing_section(figures.routing)
    if not figures.idle_floor.empty:
        st.subheader("Idle floor")
        st.plotly_chart(idle_floor_figure(figures.idle_floor), key="fleet.floor")
    for note in figures.notes:
        st.caption(note)


def duplication_section(duplication: pd.DataFrame) -> None:
    if duplication.empty:
        return
    st.subheader("Cached tokens: unique vs duplicated")
    last = duplication.iloc[-1]
    held = int(last["held_tokens"])
    cols = st.columns(3)
    cols[0].metric("held (all replicas)", f"{held:,}")
    cols[1].metric("unique", f"{int(last['unique_tokens']):,}")
    share = f" ({last['duplicated_tokens'] / held:.1%})" if held else ""
    cols[2].metric("duplicated", f"{int(last['duplicated_tokens']):,}{share}")
    st.plotly_chart(duplication_figure(duplication), key="fleet.duplication")


def routing_section(routing: pd.DataFrame) -> None:
    if routing.empty:
        return
    st.subheader("Routing loss per dispatch method")
    shown = routing.assign(loss_share=100 * routing["loss_share"])  # NOTE: '%.2f%%' prints the number as is
    st.dataframe(shown, hide_index=True, column_config=ROUTING_COLUMNS)
    st.plotly_chart(routing_figure(routing), key="fleet.routing")


def fleet_running(chosen: Selection) -> bool:
    """Whether a replica of the selected run's fleet (the latest fleet when the run is in none) still runs:
    the page follows the whole fleet, not only the selected run."""
    found = fleets.fleets_of(chosen.path)
    if not found:
        return False
    mine = next((f for f in found if any(r.run_id == chosen.run_id for r in f.replicas)), found[-1])
    runs = data.runs(chosen.path)
    ids = {r.run_id for r in mine.replicas}
    return bool((runs[runs["id"].isin(ids)]["display_status"] == "running").any())


st.header("Fleet")
chosen_run = selection()
capability.source_header(chosen_run, capability.of(chosen_run))
live.follow(panel, "fleet_panel", live_with=fleet_running)
