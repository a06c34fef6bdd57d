"""Which large capture files have passed SQLite's page check (store.quick_check), so that a reader
pays it once per version of a file, not at every open.

A verdict read from a file above store.QUICK_CHECK_MAX_BYTES waits for SQLite's check of every page
(about 2.7 s per GB: 40 s on a 100-million-event capture). Once a file passed, its identity is kept
in the user's cache (`$KVSCOPE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvscope`, else `~/.cache/kvscope`,
file `page-checks.json`): device, inode, size, modification time and SQLite's own change counter
(the file header's bytes 24-27, which every committed write bumps). A file that changed in any of
them is checked again.

NOTE: what this does not see: a page damaged underneath SQLite without any write through it (bit
rot, a disk error) after a check passed; removing the cache file makes every reader check again.
A file with a write-ahead log holding data is never remembered (its pages are not all in the file).
Failing to read or write the cache only costs the check again: it never raises.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

CACHE_FILE = "page-checks.json"
MAX_ENTRIES = 256  # NOTE: the newest files kept; an entry is ~150 bytes


def cache_path() -> Path:
    root = os.environ.get("KVSCOPE_CACHE_DIR")
    if root:
        return Path(root) / CACHE_FILE
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvscope" / CACHE_FILE


def identity(path: Path) -> str | None:
    """What must stay the same for an earlier pass to still hold; None when it cannot be told."""
    try:
        wal = Path(f"{path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            return None
        with path.open("rb") as file:
            header = file.read(28)
        stat = path.stat()
    except OSError:
        return None
    if len(header) < 28:
        return None
    counter = int.from_bytes(header[24:28], "big")
    return f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{counter}"


def _entries() -> dict[str, str]:
    try:
        found = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def passed(path: Path) -> bool:
    """Whether this version of the file passed the page check before."""
    key = identity(path)
    return key is not None and _entries().get(str(path.resolve())) == key


def remember(path: Path) -> None:
    """Keep that this version of the file passed."""
    key = identity(path)
    if key is not None:
        entries = {k: v for k, v in _entries().items() if k != str(path.resolve())}
        entries[str(path.resolve())] = key
        _write(dict(list(entries.items())[-MAX_ENTRIES:]))


def forget(path: Path) -> None:
    """Drop a file's pass (a check that found it damaged)."""
    entries = _entries()
    if entries.pop(str(path.resolve()), None) is not None:
        _write(entries)


def _write(entries: dict[str, str]) -> None:
    """Replaces the cache file at once (best effort: a cache that cannot be written is no error)."""
    target = cache_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False, suffix=".part") as out:
            json.dump(entries, out)
        os.replace(out.name, target)
    except OSError:
        return
