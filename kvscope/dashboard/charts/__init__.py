"""Pure chart builders: DataFrame in, plotly Figure (or DataFrame) out; no Streamlit here.

Every builder takes its colours from style.COLORS (one colour per series name), gives count
axes whole-number ticks (style.count_axis) and puts its legend above the plot (style.legend_above).
"""

from kvscope.dashboard.charts.capacity import capacity_figure, capacity_for, curve_frame, working_set_tokens
from kvscope.dashboard.charts.events import (
    cached_tokens_figure,
    eviction_idle_figure,
    evictions_figure,
    leak_terms_figure,
    request_timeline_figure,
)
from kvscope.dashboard.charts.style import COLORS, color, count_axis, legend_above, owner_color
from kvscope.dashboard.charts.tenants import cache_by_tenant_figure, visibility_changes_figure
from kvscope.dashboard.charts.tiers import (
    TIER_COLORS,
    TIERS,
    CopyTotals,
    copy_rates,
    copy_rates_figure,
    copy_totals,
    has_host_tier,
    host_hit_share,
    host_hit_share_figure,
    tier_tokens,
    tier_tokens_figure,
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
    "COLORS",
    "COLOR_FIELDS",
    "TIERS",
    "TIER_COLORS",
    "CopyTotals",
    "HitRates",
    "cache_by_tenant_figure",
    "cached_tokens_figure",
    "cap_nodes",
    "capacity_figure",
    "capacity_for",
    "color",
    "copy_rates",
    "copy_rates_figure",
    "copy_totals",
    "count_axis",
    "curve_frame",
    "eviction_idle_figure",
    "evictions_figure",
    "has_host_tier",
    "hit_rates",
    "host_hit_share",
    "host_hit_share_figure",
    "leak_terms_figure",
    "legend_above",
    "live_usage_figure",
    "memory_timeline_figure",
    "owner_color",
    "page_waste_figure",
    "pool_terms",
    "pools_of",
    "request_timeline_figure",
    "subtree_values",
    "tier_tokens",
    "tier_tokens_figure",
    "tree_diff",
    "tree_diff_figure",
    "tree_figure",
    "visibility_changes_figure",
    "working_set_tokens",
]
