"""`kvscope attach` as a real subprocess on a loopback server (vLLM's discovery routes) and a hand-driven
KV-event stream on ipc://: a malformed or forged message is counted and skipped (never a traceback, never
2**63 lost batches), SIGTERM (attach's normal stop) ends the run 'finished', and an attach that dies of an
error of its own closes its run 'crashed' with one line, not 'finished' by the exit-time close."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvscope.server.kv_events import BlockStored, KVEventBatch, encode_batch
from tests.attach.loopback_http import http_server, url_of
from tests.attach.test_discover import vllm_routes

TOPIC = "kv"
TIMEOUT_S = 60.0


@pytest.fixture
def stream() -> Iterator[tuple[zmq.Socket[Any], str]]:
    """An XPUB socket on a short ipc:// path (it hears the subscription, so nothing is sent too early)."""
    directory = Path(tempfile.mkdtemp(prefix="kvf-", dir="/tmp"))
    context: zmq.Context[Any] = zmq.Context()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{directory}/pub"
    xpub.bind(endpoint)
    yield xpub, endpoint
    xpub.close()
    context.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)


def page(seq: int) -> bytes:
    return encode_batch(KVEventBatch(time.time(), [BlockStored([seq + 1], None, [seq] * 4, 4, None, "GPU")], 0))


def send(xpub: zmq.Socket[Any], seq: int, body: bytes) -> None:
    xpub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), body])


def start_attach(url: str, endpoint: str, capture: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvscope",
            "attach",
            "--url",
            url,
            "--engine",
            "vllm",
            "--kv-events",
            endpoint,
            "--topic",
            TOPIC,
            "--capture",
            str(capture),
            "--scrape-s",
            "0.2",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_subscribed(xpub: zmq.Socket[Any], attach: subprocess.Popen[str]) -> None:
    assert xpub.poll(int(TIMEOUT_S * 1000)), f"attach never subscribed: {attach.communicate(timeout=5)}"
    assert xpub.recv() == b"\x01" + TOPIC.encode()
    time.sleep(0.5)  # NOTE: the subscription reaches the publisher before the SUB socket takes messages


def stored_run(capture: Path) -> tuple[str, str | None]:
    conn = sqlite3.connect(capture)
    try:
        return conn.execute("SELECT status, error FROM runs").fetchone()
    finally:
        conn.close()


def test_bad_messages_are_counted_and_sigterm_ends_the_run_finished(
    stream: tuple[zmq.Socket[Any], str], tmp_path: Path
) -> None:
    xpub, endpoint = stream
    capture = tmp_path / "a.db"
    with http_server(vllm_routes()) as server:
        attach = start_attach(url_of(server), endpoint, capture)
        try:
            wait_subscribed(xpub, attach)
            send(xpub, 0, page(0))
            send(xpub, 1, b"\x92\x01\x91" + b"\x91" * 100_000 + b"\x01")  # arrays nested 100,000 deep
            send(xpub, 2**63, page(2))  # a forged seq
            send(xpub, 2, page(2))
            time.sleep(1.5)
            attach.send_signal(signal.SIGTERM)
            out, err = attach.communicate(timeout=TIMEOUT_S)
        finally:
            attach.kill()
    assert attach.returncode == 0 and "Traceback" not in err, err
    summary = json.loads(out)
    assert summary["status"] == "finished" and summary["ended"] == "stopped by SIGTERM", summary
    counters = summary["stream"]
    assert (counters["delivered"], counters["bad_messages"], counters["lost_batches"]) == (2, 2, 1), counters
    assert stored_run(capture) == ("finished", None)


def test_an_attach_that_dies_closes_its_run_crashed(stream: tuple[zmq.Socket[Any], str], tmp_path: Path) -> None:
    """Attach runs out of memory on a message (an address-space limit set on the live process): the run is
    'crashed' with the error, attach says so in one line and exits 1."""
    xpub, endpoint = stream
    capture = tmp_path / "a.db"
    with http_server(vllm_routes()) as server:
        attach = start_attach(url_of(server), endpoint, capture)
        try:
            wait_subscribed(xpub, attach)
            send(xpub, 0, page(0))
            limit = address_space_bytes(attach.pid) + (256 << 20)
            resource.prlimit(attach.pid, resource.RLIMIT_AS, (limit, limit))
            count = 64_000_000  # NOTE: a msgpack array of 64M zeros: 64 MB to send, 512 MB of list to decode
            send(xpub, 1, b"\x92\x01\xdd" + count.to_bytes(4, "big") + bytes(count))
            out, err = attach.communicate(timeout=TIMEOUT_S)
        finally:
            attach.kill()
    assert attach.returncode == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvscope attach: error: attach crashed (MemoryError") and "closed as crashed" in last, err
    assert json.loads(out)["status"] == "crashed"
    status, error = stored_run(capture)
    assert status == "crashed" and error.startswith("MemoryError"), (status, error)


def address_space_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for {pid}")


@pytest.fixture(autouse=True)
def _unbuffered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", os.environ.get("OPENBLAS_NUM_THREADS", "1"))
