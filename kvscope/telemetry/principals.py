"""Principals and tenants. A principal is a string: "tenant/user" from an API key (serve), or a
workload's user such as "t1-u2". Its tenant is what the dashboard groups and filters by.
"""

from __future__ import annotations


def tenant_of(principal: str | None) -> str | None:
    """The part of `principal` before the first "/" if it has one, else before the first "-",
    else the whole string; None for None (no principal recorded)."""
    if principal is None:
        return None
    for sep in ("/", "-"):
        if sep in principal:
            return principal.split(sep, 1)[0]
    return principal
