"""A real `python -m kvscope serve` subprocess on a free loopback port, for the server tests:
started, waited for until it prints its URL, stopped with SIGTERM (killed if a test fails)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str
    capture: Path | None
    lines: queue.Queue[str]
    seen: dict[str, object] = field(default_factory=dict)  # what earlier tests leave for later ones

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self) -> tuple[int, str]:
        """SIGTERM (unless it already ended), then the exit code and everything it printed after 'ready'."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(STOP_TIMEOUT_S)
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return code, "".join(out)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_server(capture: Path | None, *extra: str, preexec_fn: Callable[[], None] | None = None) -> Server:
    """`kvscope serve` recording into `capture` (None: no --capture), with `extra` options (and
    `preexec_fn` run in the child before it starts, e.g. a resource limit)."""
    cmd = [
        sys.executable,
        "-m",
        "kvscope",
        "serve",
        "--port",
        "0",
        "--device",
        "cpu",
        *(["--capture", str(capture)] if capture is not None else []),
        *extra,
    ]
    process = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=preexec_fn,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    printed = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if process.poll() is not None:
                break
            continue
        printed.append(line)
        if "ready on http://" in line:
            return Server(process, line.strip().rsplit(" ", 1)[1], capture, lines)
    process.kill()
    raise AssertionError(f"the server did not get ready: {''.join(printed)}")


@contextmanager
def serving(capture: Path | None, *extra: str) -> Iterator[Server]:
    """A started server; killed on the way out if the test did not stop it."""
    server = start_server(capture, *extra)
    try:
        yield server
    finally:
        server.kill()
