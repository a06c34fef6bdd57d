"""Radix tree: the tree at any step (time travel), coloured by a field; a diff of two steps; node details."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import charts, data
from kvscope.dashboard.frame import selection

chosen = selection()
st.header("Radix tree")
bounds = data.step_range(chosen.path, chosen.run_id, chosen.stamp).iloc[0]
if pd.isna(bounds["lo"]):
    st.info("No steps recorded in this run yet.")
    st.stop()
lo, hi = int(bounds["lo"]), int(bounds["hi"])

cols = st.columns([3, 1, 1, 1])
step = cols[0].slider("step (time travel)", lo, max(hi, lo + 1), hi, key="tree.step")
color_by = cols[1].selectbox("colour by", charts.COLOR_FIELDS, key="tree.color")
max_nodes = int(cols[2].number_input("max nodes drawn", 100, 20_000, charts.tree.DEFAULT_MAX_NODES, step=100,
                                     key="tree.max_nodes"))
show_preview = cols[3].toggle("token previews", value=False, key="tree.preview",
                              help="Prompts can be private: previews stay hidden until you turn them on.")

nodes = charts.subtree_values(data.tree_at(chosen.path, chosen.run_id, step, chosen.stamp))
drawn = charts.cap_nodes(nodes, max_nodes)
st.caption(f"Step {step}: {len(nodes):,} nodes, {int(nodes['num_tokens'].sum()):,} cached tokens. Width = tokens in "
           "the subtree. " + (f"Drawing the {len(drawn):,} largest subtrees and their ancestors; the rest is blank."
                              if len(drawn) < len(nodes) else "")
           + " Nodes born after the last snapshot have approximate hit counts and access times.")
if nodes.empty:
    st.info("The tree is empty at this step.")
else:
    st.plotly_chart(charts.tree_figure(drawn, color_by, show_preview), key="tree.icicle")

    st.subheader("Node details")
    choices = drawn.sort_values("value", ascending=False)["node_id"].astype(int).tolist()  # only what is drawn
    node_id = st.selectbox(f"node (the {len(choices):,} drawn, largest subtrees first)", choices, key="tree.node")
    detail = nodes[nodes["node_id"] == node_id].drop(columns=[] if show_preview else ["token_preview"])
    st.dataframe(detail, hide_index=True)

st.subheader("What changed between two steps")
diff_cols = st.columns(2)
before_step = diff_cols[0].number_input("from step", lo, hi, max(lo, step - 10), key="tree.diff_from")
after_step = diff_cols[1].number_input("to step", lo, hi, step, key="tree.diff_to")
diff = charts.tree_diff(data.tree_at(chosen.path, chosen.run_id, int(before_step), chosen.stamp),
                        data.tree_at(chosen.path, chosen.run_id, int(after_step), chosen.stamp))
if diff.empty:
    st.caption("No node changed size between these steps.")
else:
    grew = int(diff.loc[diff["delta"] > 0, "delta"].sum())
    lost = int(-diff.loc[diff["delta"] < 0, "delta"].sum())
    st.caption(f"{grew:,} tokens grew (new nodes and extended ones), {lost:,} tokens went (evicted, or moved into "
               "a new upper node by a split).")
    st.plotly_chart(charts.tree_diff_figure(diff), key="tree.diff")
    st.dataframe(diff, hide_index=True)
