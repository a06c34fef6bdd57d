"""Radix tree: the tree at any step (time travel), coloured by a field; a diff of two steps; node details
with the requests holding its locks (or, on a ref-counted block source, its references). The step and
the node are in the URL (?step=, ?node=). A source whose tree is the page forest of its KV events
gets that forest at its snapshot steps."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import (
    capability,
    charts,
    data,
    leak_views,
    live,
    node_details,
    reads,
    reported,
    retained,
    tenants,
    url_state,
)
from kvscope.dashboard.frame import Selection, selection
from kvscope.dashboard.timing import COUNTER_CLOCK_CACHES, Clock, zone_name
from kvscope.telemetry.capabilities import Capabilities, capabilities_of_json

STEP_KEY = "tree.step"
FOLLOW_KEY = "tree.follow"
CHOSEN_KEY = "tree.chosen_step"  # (capture, run, step) the user or a link chose: kept while the run grows
NODE_KEY = "tree.node"
ICICLE_KEY = "tree.icicle"
CLICKED_KEY = "tree.clicked"  # the icicle click last applied to the node picker (a selection stays set)
DETAIL_COLUMNS = {  # NOTE: 720 px: fits beside the sidebar on a 1280-px-wide window
    "field": st.column_config.TextColumn("field", width=300),
    "value": st.column_config.TextColumn("value", width=420),
}


def _moved(path: str, run_id: int) -> None:
    """The slider moved: remember the step and stop following the newest one."""
    st.session_state[CHOSEN_KEY] = (path, run_id, int(st.session_state[STEP_KEY]))
    st.session_state[FOLLOW_KEY] = False


def _chosen_step(chosen: Selection) -> int | None:
    path, run_id, step = st.session_state.get(CHOSEN_KEY, (None, None, None))
    return step if (path, run_id) == (chosen.path, chosen.run_id) else None


def _apply_link_step(chosen: Selection, lo: int, hi: int) -> None:
    linked = url_state.pending("step")
    if linked is None:
        return
    if lo <= linked <= hi:
        st.session_state[CHOSEN_KEY] = (chosen.path, chosen.run_id, linked)
        st.session_state[FOLLOW_KEY] = False
    else:
        url_state.note(f"The link's step {linked} is outside this run's steps {lo}–{hi}: showing the newest step.")


def pick_step(chosen: Selection, lo: int, hi: int) -> int:
    """NOTE: the slider's range grows with a live run, and a new range makes a new slider (its
    key is not its whole identity): the value comes from our own state, the newest step while
    'follow newest' is on, else the step last chosen (clamped to the range)."""
    _apply_link_step(chosen, lo, hi)
    st.session_state.setdefault(FOLLOW_KEY, True)
    follow = chosen.running and st.toggle(
        "follow newest",
        key=FOLLOW_KEY,
        help="Show each new step as the run records it. Moving the slider turns this off.",
    )
    remembered = _chosen_step(chosen)
    wanted = hi if follow or remembered is None else min(max(remembered, lo), hi)
    st.session_state[STEP_KEY] = wanted
    step = int(
        st.slider(
            "step (time travel)", lo, max(hi, lo + 1), key=STEP_KEY, on_change=_moved, args=(chosen.path, chosen.run_id)
        )
    )
    if remembered is not None:
        st.session_state[CHOSEN_KEY] = (chosen.path, chosen.run_id, step)
    url_state.publish(step=step)
    return step


def step_caption(chosen: Selection, clock: Clock | None, step: int, nodes: pd.DataFrame, drawn: pd.DataFrame) -> None:
    row = data.usage_at(chosen.path, chosen.run_id, chosen.stamp, step)
    moment = None if clock is None or row.empty else clock.stamp(float(row["t_mono"].iloc[0]))
    when = "" if moment is None else f" (recorded {moment} {zone_name()})"
    below_root = int(nodes["parent_id"].notna().sum())
    st.caption(
        f"Step {step}: {below_root:,} nodes below the root, {int(nodes['num_tokens'].sum()):,} cached tokens"
        f"{when}. Width = "
        "tokens in the subtree. "
        + (
            f"Drawing the {len(drawn):,} largest subtrees and their ancestors; the rest is blank."
            if len(drawn) < len(nodes)
            else ""
        )
        + " Nodes born after the last snapshot have approximate hit counts and access times."
    )


def _apply_click(clicked: int | None, choices: list[int]) -> None:
    """A click on the icicle picks its node, once per click (the chart's selection stays set
    over reruns: the picker must stay free to move)."""
    if clicked is None or clicked == st.session_state.get(CLICKED_KEY):
        return
    st.session_state[CLICKED_KEY] = clicked
    if clicked in choices:
        st.session_state[NODE_KEY] = clicked
    else:
        st.caption(f"Node {clicked} is not among the nodes listed here (the tenant filter).")


def pick_node(drawn: pd.DataFrame, nodes: pd.DataFrame, clicked: int | None) -> int:
    choices = drawn.sort_values("value", ascending=False)["node_id"].astype(int).tolist()  # only what is drawn
    _apply_click(clicked, choices)
    linked = url_state.pending("node")
    if linked is not None:
        if linked in set(nodes["node_id"].astype(int)):
            choices = [linked, *[c for c in choices if c != linked]]
            st.session_state[NODE_KEY] = linked
        else:
            url_state.note(f"The link's node {linked} is not in the tree at this step.")
    if st.session_state.get(NODE_KEY) not in choices:
        st.session_state[NODE_KEY] = choices[0]
    node_id = int(
        st.selectbox(
            f"node (the {len(choices):,} drawn, largest subtrees first; or click one in the tree)",
            choices,
            key=NODE_KEY,
        )
    )
    url_state.publish(node=node_id)
    return node_id


def details_section(
    chosen: Selection,
    clock: Clock | None,
    step: int,
    nodes: pd.DataFrame,
    drawn: pd.DataFrame,
    show_preview: bool,
    clicked: int | None,
) -> None:
    st.subheader("Node details")
    node_id = pick_node(drawn, nodes, clicked)
    detail = nodes[nodes["node_id"] == node_id]
    caps = capabilities_of_json(getattr(chosen.run, "config", None))
    if len(detail):
        counter_clock = data.cache_kind(chosen.run) in COUNTER_CLOCK_CACHES
        table = node_details.details_frame(detail.iloc[0], clock, counter_clock, caps.has("refs"), show_preview)
        st.dataframe(table, hide_index=True, column_config=DETAIL_COLUMNS)
        if not counter_clock and clock is not None:
            st.caption(f"Times are {zone_name()}; a node born after the last snapshot has an approximate access time.")
    refs = int(detail["lock_ref"].fillna(0).iloc[0]) if len(detail) else 0
    if caps.has("locks"):
        lock_holders(chosen, step, node_id, nodes, refs)
    elif caps.has("refs", "ownership"):
        is_root = nodes.loc[nodes["node_id"] == node_id, "parent_id"].isna().all()
        if is_root:
            st.caption("The root stands for the empty prefix: it is no block. Pick a block below it for its holders.")
        else:
            block_holders(chosen, step, node_id, refs)


def lock_holders(chosen: Selection, step: int, node_id: int, nodes: pd.DataFrame, lock_ref: int) -> None:
    if lock_ref <= 0:
        return
    is_root = nodes.loc[nodes["node_id"] == node_id, "parent_id"].isna().all()  # NOTE: or an unknown node
    if not reads.has_lock_events(chosen.path, chosen.run_id, chosen.stamp):
        st.caption(
            f"Node {node_id} has {lock_ref} lock(s)"
            + (" (its own, permanent: a lock below does not add to it)" if is_root else "")
            + "; who holds locks needs a capture recorded at level full."
        )
        return
    held = reads.held_locks(chosen.path, chosen.run_id, chosen.stamp, step)
    holders = leak_views.holders_of(node_id, held, nodes)
    if is_root:
        st.caption(
            f"The root's own lock is permanent, and its lock count does not include the locks below it. Every "
            f"lock holds the path up to the root: {len(holders):,} lock(s) held at step {step}"
            + (", by these holders:" if len(holders) else ".")
        )
        if len(holders):
            st.dataframe(holders, hide_index=True)
        return
    if holders.empty:
        st.caption(f"Node {node_id} has {lock_ref} lock(s) (the root's is permanent).")
        return
    st.caption(
        f"Node {node_id} is locked {lock_ref} time(s) at step {step}, held by these requests (a lock on a node "
        "below it holds it too):"
    )
    st.dataframe(holders, hide_index=True)


def block_holders(chosen: Selection, step: int, block: int, refs: int) -> None:
    """The requests holding references on a block at `step`, from the takes and releases."""
    holders = leak_views.block_holders(reads.block_events(chosen.path, chosen.run_id, chosen.stamp), step, block)
    if holders.empty:
        st.caption(
            f"Block {block} has no holder at step {step}"
            + (f" (its ref count says {refs}: a reference no recorded request took)" if refs else "")
            + "."
        )
        return
    st.caption(
        f"Block {block} is held by these requests after step {step} (their takes minus their releases; "
        f"its ref count: {refs}):"
    )
    st.dataframe(holders, hide_index=True)


def diff_section(chosen: Selection, lo: int, hi: int, step: int) -> None:
    st.subheader("What changed between two steps")
    diff_cols = st.columns(2)
    before_step = diff_cols[0].number_input("from step", lo, hi, max(lo, step - 10), key="tree.diff_from")
    after_step = diff_cols[1].number_input("to step", lo, hi, step, key="tree.diff_to")
    diff = charts.tree_diff(
        data.tree_at(chosen.path, chosen.run_id, int(before_step), chosen.stamp),
        data.tree_at(chosen.path, chosen.run_id, int(after_step), chosen.stamp),
    )
    if diff.empty:
        st.caption("No node changed size between these steps.")
        return
    grew = int(diff.loc[diff["delta"] > 0, "delta"].sum())
    lost = int(-diff.loc[diff["delta"] < 0, "delta"].sum())
    st.caption(
        f"{grew:,} tokens grew (new nodes and extended ones), {lost:,} tokens went (evicted, or moved into "
        "a new upper node by a split)."
    )
    st.plotly_chart(charts.tree_diff_figure(diff), key="tree.diff")
    st.dataframe(diff, hide_index=True)


def panel(chosen: Selection) -> None:
    """The step picker and the tree at that step (refreshed while the run is running: with 'follow
    newest' on, the step follows the run's newest)."""
    notes = st.container()
    bounds = data.step_range(chosen.path, chosen.run_id, chosen.stamp).iloc[0]
    if pd.isna(bounds["lo"]):
        url_state.show_notes()
        st.info("No steps recorded in this run yet.")
        return
    lo, hi = int(bounds["lo"]), int(bounds["hi"])
    clock = reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run)

    cols = st.columns([3, 1, 1, 1])
    with cols[0]:
        step = pick_step(chosen, lo, hi)
    color_by = cols[1].selectbox(
        "colour by",
        charts.COLOR_FIELDS,
        key="tree.color",
        help="owner: the principal that inserted the node; visibility: private (its owner "
        "only), public, pinned (scoped radix; other caches share every node: public); "
        "tier: device, device+host (a host copy too) or host only (hiradix; other caches "
        "keep every node on the device)",
    )
    max_nodes = int(
        cols[2].number_input(
            "max nodes drawn", 100, 20_000, charts.tree.DEFAULT_MAX_NODES, step=100, key="tree.max_nodes"
        )
    )
    show_preview = cols[3].toggle(
        "token previews",
        value=False,
        key="tree.preview",
        help="Prompts can be private: previews stay hidden until you turn them on.",
    )
    tree_section(chosen, clock, step, color_by, max_nodes, show_preview)
    with notes:
        url_state.show_notes()
    diff_section(chosen, lo, hi, step)


def tree_section(
    chosen: Selection, clock: Clock | None, step: int, color_by: str, max_nodes: int, show_preview: bool
) -> None:
    nodes = charts.subtree_values(data.tree_at(chosen.path, chosen.run_id, step, chosen.stamp))
    drawn = charts.cap_nodes(nodes, max_nodes)
    step_caption(chosen, clock, step, nodes, drawn)
    if nodes.empty:
        st.info("The tree is empty at this step.")
    else:
        event = st.plotly_chart(
            charts.tree_figure(drawn, color_by, show_preview),
            key=ICICLE_KEY,
            on_select="rerun",
            selection_mode="points",
        )
        clicked = node_details.clicked_node(event)
        listed = drawn if chosen.tenant is None else tenants.of_tenant(drawn, chosen.tenant, column="owner")
        if chosen.tenant is not None:
            st.caption(
                f"The tree is drawn whole; node details list the {len(listed):,} drawn nodes owned by tenant "
                f"**{chosen.tenant}**" + (" (none at this step)." if listed.empty else ".")
            )
        if not listed.empty:
            details_section(chosen, clock, step, nodes, listed, show_preview, clicked)


def page(chosen: Selection, caps: Capabilities) -> None:
    capability.source_header(chosen, caps)
    if caps.lacks("tree"):  # NOTE: the engine's page forest from its KV events, at its snapshot steps
        reported.forest(chosen, caps)
        return
    if caps.has("refs"):
        st.caption(
            f"One node per cached block of {caps.engine}, under the block before it in its hash chain; "
            "**lock_ref** is the block's ref count (colour by it), and a block's details list the requests "
            "that hold it. "
            + (
                "Between snapshots the tree follows the insert and evict events, which carry "
                "no ref counts: a block's count is the one of the latest snapshot."
                if caps.has("tree_snapshots")
                else "No snapshot is stored: the tree is "
                "rebuilt from the insert and evict events alone, so every ref count reads 0 "
                "(the holders below come from the takes and releases)."
            )
        )
    live.follow(panel, "tree")


chosen = selection()
st.header("Radix tree")
retained.dropped_line(chosen)
page(chosen, capability.of(chosen))
