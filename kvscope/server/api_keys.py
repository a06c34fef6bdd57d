"""The `--api-keys` file that `serve` authenticates with and `load` sends under: a JSON object
mapping each key to its principal, {"KEY": {"tenant": "acme", "user": "alice"}}, read here once
for both (tenant and user: non-empty, without '/', since the principal is "tenant/user"); and a
request's principal on the server (resolve_principal).

NOTE: principals (docs/serve.md)
    no --api-keys   principal = the request's `user` (or None)
    --api-keys      a key maps to {"tenant": T, "user": U}; principal = "T/U". A request `user`
                    may only narrow it: "S" (no slash) or "T/U/S" both give "T/U/S"; "T/U" is
                    the key's own principal; any other value with a slash (another tenant, or
                    another user of the same tenant) is 403.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvscope.server.errors import ApiError


@dataclass(frozen=True)
class Principal:
    tenant: str
    user: str


def load_api_keys(path: str | Path) -> dict[str, Principal]:
    """The keys file: a JSON object {key: {"tenant": T, "user": U}}; ValueError on a bad one."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--api-keys {path}: not JSON ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--api-keys {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"--api-keys {path}: expected a non-empty object {{key: {{tenant, user}}}}")
    keys = {}
    for key, who in raw.items():
        if not key or not isinstance(who, dict):
            raise ValueError(f'--api-keys {path}: key {key!r} must map to {{"tenant": ..., "user": ...}}')
        tenant, user = who.get("tenant"), who.get("user")
        for name, value in (("tenant", tenant), ("user", user)):
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(f"--api-keys {path}: key {key[:4]}…: {name} must be a non-empty string without '/'")
        keys[key] = Principal(str(tenant), str(user))
    return keys


def resolve_principal(keys: dict[str, Principal] | None, authorization: str | None, user: str | None) -> str | None:
    """The request's principal (see the module NOTE); ApiError 401 or 403."""
    if keys is None:
        return user
    scheme, _, key = (authorization or "").partition(" ")
    who = keys.get(key.strip()) if scheme.lower() == "bearer" else None
    if who is None:
        message = "missing API key (Authorization: Bearer KEY)" if not authorization else "invalid API key"
        raise ApiError(401, message, code="invalid_api_key")
    base = f"{who.tenant}/{who.user}"
    if not user or user == base:
        return base
    if "/" not in user:
        return f"{base}/{user}"
    if user.startswith(base + "/") and user != base + "/":
        return user
    raise ApiError(
        403,
        f"user {user!r} is outside this key's principal {base!r}",
        type_="permission_error",
        param="user",
        code="permission_denied",
    )
