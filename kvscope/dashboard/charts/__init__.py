"""Pure chart builders: DataFrame in, plotly Figure (or DataFrame) out; no Streamlit here."""

from kvscope.dashboard.charts.capacity import capacity_figure, capacity_for, curve_frame
from kvscope.dashboard.charts.events import (
    cached_tokens_figure,
    eviction_idle_figure,
    evictions_figure,
    leak_terms_figure,
    request_timeline_figure,
)
from kvscope.dashboard.charts.tree import (
    COLOR_FIELDS,
    cap_nodes,
    subtree_values,
    tree_diff,
    tree_diff_figure,
    tree_figure,
)
from kvscope.dashboard.charts.usage import (
    HitRates,
    hit_rates,
    live_usage_figure,
    memory_timeline_figure,
    page_waste_figure,
    pool_terms,
    pools_of,
)

__all__ = [
    "COLOR_FIELDS",
    "HitRates",
    "cached_tokens_figure",
    "cap_nodes",
    "capacity_figure",
    "capacity_for",
    "curve_frame",
    "eviction_idle_figure",
    "evictions_figure",
    "hit_rates",
    "leak_terms_figure",
    "live_usage_figure",
    "memory_timeline_figure",
    "page_waste_figure",
    "pool_terms",
    "pools_of",
    "request_timeline_figure",
    "subtree_values",
    "tree_diff",
    "tree_diff_figure",
    "tree_figure",
]
