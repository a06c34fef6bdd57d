"""`kvscope serve` whose capture stops recording (the disk is full: here a file-size limit) serves
on unrecorded and, when stopped, says the capture is incomplete and exits 4, as `run` and `attach`
do; no leak report is stored into a capture that cannot be written."""

from __future__ import annotations

import resource
import signal
import sqlite3
from pathlib import Path

import httpx

from tests.server.serving import start_server

FILE_LIMIT_BYTES = 400_000


def limit_files() -> None:  # in the child: writes past the limit fail with EFBIG instead of killing it
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT_BYTES, FILE_LIMIT_BYTES))


def test_a_capture_that_stops_recording_makes_serve_exit_4(tmp_path: Path) -> None:
    capture = tmp_path / "c.db"
    server = start_server(capture, preexec_fn=limit_files)
    try:
        said = []
        for i in range(400):  # NOTE: until the writer fails; each request records its events
            body = {"model": "kvscope-tiny", "prompt": f"request {i} " * 40, "max_tokens": 16}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
            while not server.lines.empty():
                said.append(server.lines.get())
            if any("recording stopped" in line for line in said):
                break
        assert any("recording stopped" in line for line in said), "".join(said)
        code, printed = server.stop()
    finally:
        server.kill()
    assert code == 4, printed
    assert "Traceback" not in printed and "kvscope serve: run " not in printed, printed
    assert printed.rstrip().splitlines()[-1].endswith(f"capture {capture} (incomplete: recording stopped)"), printed
    conn = sqlite3.connect(f"file:{capture}?mode=ro", uri=True)
    try:
        assert conn.execute("SELECT status FROM runs").fetchone()[0] == "incomplete"
    finally:
        conn.close()
