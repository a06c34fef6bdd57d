"""The pure chart builders, on small hand-made frames."""

from __future__ import annotations

import pandas as pd
import pytest

from kvscope.dashboard import charts, data

NODES = pd.DataFrame(
    {
        "node_id": [0, 1, 2, 3, 4],
        "parent_id": pd.array([None, 0, 1, 1, 0], dtype="Int64"),
        "num_tokens": [0, 10, 5, 7, 3],
        "token_preview": ["", "1 2 3 …", "4 5 …", "6 …", "7 …"],
        "lock_ref": [1, 1, 0, 1, 0],
        "last_access_time": [10.0, 9.0, 4.0, 8.0, 2.0],
        "hit_count": [0, 5, 1, 3, 1],
        "owner": [None, "u0", "u0", "u1", None],
        "tombstone": [False, False, True, False, False],
        "depth_tokens": [0, 10, 15, 17, 3],
    }
)


def usage_frame(swa: bool) -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            "step": [0, 1, 2],
            "t_mono": [0.0, 1.0, 2.0],
            "full_total": [100] * 3,
            "full_available": [100, 60, 40],
            "full_evictable": [0, 20, 30],
            "full_protected": [0, 10, 20],
            "swa_total": [80] * 3 if swa else [None] * 3,
            "swa_available": [80, 50, 30] if swa else [None] * 3,
            "swa_evictable": [0, 10, 20] if swa else [None] * 3,
            "swa_protected": [0, 10, 10] if swa else [None] * 3,
            "num_running": [0, 2, 3],
            "num_waiting": [3, 1, 0],
            "cum_prompt_tokens": [0, 100, 200],
            "cum_hit_tokens": [0, 10, 150],
            "cum_requests": [0, 2, 4],
            "cum_hit_requests": [0, 1, 1],
            "cum_evicted_tokens": [0, 0, 5],
            "cum_retractions": [0, 0, 1],
        }
    )
    return frame


def test_subtree_values_sum_every_descendant() -> None:
    values = charts.subtree_values(NODES).set_index("node_id")["value"]
    assert values.to_dict() == {0: 25, 1: 22, 2: 5, 3: 7, 4: 3}


def test_idle_is_measured_from_the_newest_access() -> None:
    idle = charts.subtree_values(NODES).set_index("node_id")["idle"]
    assert idle[0] == 0 and idle[4] == 8


def test_cap_keeps_the_ancestors_of_every_kept_node() -> None:
    capped = charts.cap_nodes(charts.subtree_values(NODES), max_nodes=1)
    kept = set(capped["node_id"])
    assert kept == {0}  # the largest subtree is the root's
    capped = charts.cap_nodes(charts.subtree_values(NODES), max_nodes=2)
    assert {0, 1} <= set(capped["node_id"]) and len(capped) == 2


def test_cap_of_a_deep_node_pulls_its_path_in() -> None:
    nodes = charts.subtree_values(NODES)
    nodes.loc[nodes.node_id == 3, "value"] = 1000  # pretend node 3 is the biggest
    capped = charts.cap_nodes(nodes, max_nodes=1)
    assert set(capped["node_id"]) == {3, 1, 0}


@pytest.mark.parametrize("color_by", charts.COLOR_FIELDS)
def test_tree_figure_sizes_by_subtree_tokens(color_by: str) -> None:
    fig = charts.tree_figure(charts.subtree_values(NODES), color_by)
    trace = fig.data[0]
    assert list(trace.values) == [25, 22, 5, 7, 3]
    assert list(trace.parents) == ["", "0", "1", "1", "0"]
    assert trace.branchvalues == "total"


def test_token_previews_stay_hidden_unless_asked() -> None:
    nodes = charts.subtree_values(NODES)
    hidden = " ".join(charts.tree_figure(nodes, "lock_ref").data[0].hovertext)
    shown = " ".join(charts.tree_figure(nodes, "lock_ref", show_preview=True).data[0].hovertext)
    assert "1 2 3" not in hidden and "1 2 3" in shown


def test_tree_figure_rejects_an_unknown_field() -> None:
    with pytest.raises(ValueError, match="colour by"):
        charts.tree_figure(charts.subtree_values(NODES), "colour")


def test_tree_diff_names_what_grew_and_what_was_evicted() -> None:
    after = NODES[NODES.node_id != 4].copy()
    after.loc[after.node_id == 2, "num_tokens"] = 9
    after.loc[after.node_id == 3, "num_tokens"] = 2
    after = pd.concat([after, NODES[NODES.node_id == 4].assign(node_id=9)])
    diff = charts.tree_diff(NODES, after).set_index("node_id")
    assert diff["change"].to_dict() == {2: "grew", 3: "shrank", 4: "evicted", 9: "new"}
    assert diff.loc[3, "delta"] == -5
    assert len(charts.tree_diff_figure(diff.reset_index()).data[0].x) == 4


def test_pool_terms_stack_to_the_total() -> None:
    terms = charts.pool_terms(usage_frame(swa=False), "full")
    stacked = terms[["free", "evictable", "protected", "requests"]].sum(axis=1)
    assert (stacked == terms["total"]).all()
    assert terms["requests"].tolist() == [0, 10, 10]


def test_memory_timeline_puts_swa_beside_full() -> None:
    assert charts.pools_of(usage_frame(swa=False)) == ["full"]
    fig = charts.memory_timeline_figure(usage_frame(swa=True))
    assert {t.xaxis for t in fig.data} == {"x", "x2"}
    assert len(fig.data) == 8


def test_hit_rates_are_ratios_of_sums_and_labelled_apart() -> None:
    rates = charts.hit_rates(usage_frame(swa=False).iloc[-1])
    assert rates.token_weighted == pytest.approx(0.75) and rates.request_weighted == pytest.approx(0.25)
    assert charts.hit_rates(usage_frame(swa=False).iloc[0]) == (None, None)


def test_page_waste_counts_the_unused_tail_of_the_last_page() -> None:
    waste = data.page_waste(pd.DataFrame({"rid": ["a", "b", "c"], "seq_len": [8, 9, 15]}), page_size=4)
    assert waste["wasted_slots"].tolist() == [0, 3, 1]
    assert waste["slots_held"].tolist() == [8, 12, 16]
    assert len(charts.page_waste_figure(waste).data) == 2


def test_request_timeline_marks_prefill_chunks_inside_prefill_only() -> None:
    requests = pd.DataFrame(
        {
            "rid": ["r0", "r1"],
            "arrive_step": [0, 0],
            "admit_step": [1, 2],
            "first_token_step": [3, 2],
            "finish_step": [6, 5],
            "retract_step": [None, 4.0],
        }
    )
    allocs = pd.DataFrame({"rid": ["r0", "r0", "r0", "r1"], "step": [1, 3, 5, 2], "tokens": [256, 100, 1, 30]})
    fig = charts.request_timeline_figure(requests, allocs)
    chunks = next(t for t in fig.data if t.name == "prefill chunk")
    assert list(chunks.x) == [1, 3, 2]
    retracted = next(t for t in fig.data if t.name == "retracted")
    assert list(retracted.y) == ["r1"]


def test_leak_terms_mark_the_onset_and_failed_checks() -> None:
    checks = pd.DataFrame(
        {
            "step": [5, 9],
            "pool": ["full", "full"],
            "total": [100, 100],
            "available": [100, 90],
            "evictable": [0, 0],
            "protected": [0, 0],
            "held": [0, 0],
            "uncached": [0, 0],
            "ok": [True, False],
        }
    )
    fig = charts.leak_terms_figure(checks, usage_frame(swa=False), onset_step=7, first_failure_step=9)
    failed = next(t for t in fig.data if t.name == "full: check failed")
    assert list(failed.x) == [9]
    assert {shape.x0 for shape in fig.layout.shapes} == {7, 9}


def test_eviction_figures_split_regret() -> None:
    log = pd.DataFrame(
        {
            "age_steps": [5, 9],
            "idle_steps": [2, 8],
            "evicted_tokens": [10, 20],
            "node_id": [1, 2],
            "regret_tokens": [0, 7],
        }
    )
    fig = charts.eviction_idle_figure(log)
    assert [len(t.x) for t in fig.data] == [1, 1]
    per_step = pd.DataFrame({"step": [1, 2], "num_evictions": [1, 3], "evicted_tokens": [5, 9]})
    assert len(charts.evictions_figure(per_step).data) == 2
    requests = pd.DataFrame({"rid": ["a"], "prompt_len": [10], "cached_tokens": [4]})
    assert list(charts.cached_tokens_figure(requests).data[1].y) == [6]


def test_capacity_for_a_target_is_the_first_capacity_that_reaches_it() -> None:
    import numpy as np

    from kvscope.dashboard.charts import capacity_figure, capacity_for, curve_frame

    curve = curve_frame(np.array([10, 40, 90]), np.array([20, 50, 60]), prompt_tokens=100)
    assert curve["hit_rate"].tolist() == [0.0, 0.2, 0.5, 0.6]
    assert capacity_for(curve, 0.5) == 40 and capacity_for(curve, 0.55) == 90 and capacity_for(curve, 0.7) is None
    assert capacity_for(curve, 0.0) == 0
    fig = capacity_figure(curve, 0.5, 40, gpu_tokens=1000)
    assert fig.data[0].y.tolist() == [0.0, 0.2, 0.5, 0.6]
