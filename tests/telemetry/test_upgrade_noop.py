"""`kvscope upgrade` on a capture with nothing to upgrade leaves the file as it was: not opened for
writing, not migrated, not settled (a copy in a backup or under a checksum stays the same)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from kvscope.app import main
from kvscope.telemetry import Capture
from kvscope.telemetry.upgrade import upgrade

V5 = sorted((Path(__file__).parent / "data" / "v5").glob("*.db"))


def digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def test_a_packed_current_capture_is_left_byte_for_byte(tmp_path: Path, capsys) -> None:
    path = tmp_path / "old.db"
    shutil.copy(V5[0], path)
    assert upgrade(path)  # NOTE: a v5 file has row-layout events: packed and migrated
    before = digest(path)
    assert main(["upgrade", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: nothing to upgrade (every run is packed already)\n"
    assert digest(path) == before
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    capture = Capture(path)
    try:
        assert len(capture.runs()) >= 1
    finally:
        capture.close()
