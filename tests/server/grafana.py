"""The series a Grafana dashboard's PromQL queries select: each metric name with its label matchers.

    selectors(json.loads(path.read_text()))  # -> [Selector("sglang:num_running_reqs", ()), ...]

Enough PromQL for dashboards built of functions over selectors: a selector is a metric name
(letters, digits, `_` and `:`) that is not followed by `(`, with an optional `{label op "value", ...}`.
Keywords and function names are followed by `(` or are not metric-shaped (`by (le)`, `sum`)."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

SELECTOR = re.compile(r"(?<![\w:$])([a-zA-Z_:][\w:]*)(?![\w:])\s*(\{[^}]*\})?(?!\s*\()")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "le",
}


class Selector(NamedTuple):
    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


def exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every target's PromQL, panel by panel (rows' nested panels included)."""
    out: list[str] = []
    for panel in dashboard.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            out += [t["expr"] for t in inner.get("targets", []) if t.get("expr")]
    return out


def selectors(expr: str) -> list[Selector]:
    """The selectors of one expression; durations (`[5m]`) and grouping labels are not selectors."""
    text = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors: [$__rate_interval]
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping label lists
    out = []
    for name, braces in SELECTOR.findall(text):
        if name in KEYWORDS or re.fullmatch(r"[\d.]+", name):
            continue
        out.append(Selector(name, tuple(MATCHER.findall(braces or ""))))
    return out


def template_labels(dashboard: dict[str, Any]) -> list[str]:
    """The labels the template variables list values of (`label_values(model_name)` -> model_name)."""
    out = []
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        found = re.fullmatch(r"label_values\((?:.*,\s*)?(\w+)\)", text.strip())
        if found:
            out.append(found.group(1))
    return out
