"""The `--api-keys` file that `serve` authenticates with and `load` sends under: a JSON object
mapping each key to its principal, {"KEY": {"tenant": "acme", "user": "alice"}}, read here once
for both (tenant and user: non-empty, without '/', since the principal is "tenant/user")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


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
