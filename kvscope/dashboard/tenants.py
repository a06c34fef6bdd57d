"""Tenants: the sidebar's tenant filter (in the URL as ?tenant=) and the pure tables of the
sharing views (cache tokens per tenant by visibility, cross-principal reuse).

NOTE: a tenant is kvscope.telemetry.tenant_of(principal): "acme/alice" -> "acme", "t1-u2" -> "t1",
"alice" -> "alice". A node's tenant is its owner's; a node with no owner is "no owner".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import pandas as pd
import streamlit as st

from kvscope.dashboard import url_state
from kvscope.telemetry import tenant_of

ALL_TENANTS = "all tenants"
TENANT_KEY = "kvscope.tenant"
NO_OWNER = "no owner"
VISIBILITY_ORDER = ("private", "public", "pinned")


def tenant_choices(principals: Iterable[str | None]) -> list[str]:
    """The distinct tenants of these principals, sorted."""
    return sorted({t for t in map(tenant_of, principals) if t is not None})


def pick_tenant(principals: Iterable[str | None]) -> str | None:
    """The sidebar's tenant filter: None for all tenants. A link's ?tenant= applies once."""
    choices = tenant_choices(principals)
    linked = url_state.pending("tenant")
    if linked is not None:
        if linked in choices:
            st.session_state[TENANT_KEY] = linked
        else:
            url_state.note(f"The link's tenant {linked!r} has no requests in this run: showing all tenants.")
    if st.session_state.get(TENANT_KEY) not in (ALL_TENANTS, *choices):
        st.session_state[TENANT_KEY] = ALL_TENANTS
    picked = str(
        st.sidebar.selectbox(
            "Tenant",
            [ALL_TENANTS, *choices],
            key=TENANT_KEY,
            help="Tenant = the part of a principal before '/' (an API key's "
            "tenant/user), else before '-' (a workload user 't1-u2').",
        )
    )
    return None if picked == ALL_TENANTS else picked


def of_tenant(frame: pd.DataFrame, tenant: str | None, column: str = "principal") -> pd.DataFrame:
    """The rows whose `column` (a principal) belongs to `tenant`; every row for None."""
    if tenant is None or frame.empty:
        return frame
    return frame[[tenant_of(p) == tenant if isinstance(p, str) else False for p in frame[column]]]


def cache_by_tenant(nodes: pd.DataFrame) -> pd.DataFrame:
    """Tokens in the cache per tenant (of the node's owner) and visibility: tenant, visibility,
    num_tokens, num_nodes. The root holds no tokens and is left out."""
    body = nodes[nodes["parent_id"].notna()]
    if body.empty:
        return pd.DataFrame(columns=["tenant", "visibility", "num_tokens", "num_nodes"])
    owners = [tenant_of(o) if isinstance(o, str) and o else NO_OWNER for o in body["owner"]]
    seen = body.reindex(columns=["visibility"])["visibility"]
    table = pd.DataFrame(
        {
            "tenant": owners,
            "visibility": seen.where(seen.notna(), "visibility not recorded"),
            "num_tokens": body["num_tokens"].astype(int),
        }
    )
    return (
        table.groupby(["tenant", "visibility"], as_index=False)
        .agg(num_tokens=("num_tokens", "sum"), num_nodes=("num_tokens", "size"))
        .sort_values(["tenant", "visibility"])
        .reset_index(drop=True)
    )


class ReuseShare(NamedTuple):
    """Tokens prefix matches reused, and the part of them in nodes another principal owns."""

    cross_tokens: int
    matched_tokens: int

    @property
    def share(self) -> float | None:
        return self.cross_tokens / self.matched_tokens if self.matched_tokens else None


def reuse_share(reuse: pd.DataFrame, tenant: str | None) -> ReuseShare:
    """From reuse_by_principal: the requests of `tenant` (all for None)."""
    rows = of_tenant(reuse, tenant)
    return ReuseShare(int(rows["cross_tokens"].sum()), int(rows["matched_tokens"].sum()))
