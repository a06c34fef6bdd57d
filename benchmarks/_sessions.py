"""Light dashboard sessions for bench_readers.py: each is one websocket to a running Streamlit server,
speaking the browser's protocol (BackMsg / ForwardMsg protobufs over /_stcore/stream), without a browser.

A session opens the default page (the Overview) the way a browser does (one rerun request with the
page's query string), and then follows its live panel as the browser does: for each fragment the
server asks to rerun every N seconds (ForwardMsg.auto_rerun), it sends a fragment rerun request
every N seconds (BackMsg.rerun_script with the fragment's id, is_auto_rerun). It parses each
ForwardMsg only to see script_finished and auto_rerun, and renders nothing: the client side of a
session costs this machine a websocket read and one protobuf parse per message, where a browser would
lay out and draw every delta on its viewer's own machine.

NOTE: timings
    page settle      a session's first request -> the server's script_finished for it (the whole page,
                     its live panel's first run included)
    refresh settle   a fragment rerun request -> the server's script_finished for that fragment run
                     (a request the server merged with one still queued settles with it)
Widgets: a session sends no widget states (its viewer touches nothing; the server keeps each keyed
widget's value in the session's state).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

FINISHED = {ForwardMsg.FINISHED_SUCCESSFULLY, ForwardMsg.FINISHED_FRAGMENT_RUN_SUCCESSFULLY}


@dataclass
class SessionTimes:
    page_s: list[float] = field(default_factory=list)
    refresh_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    num_messages: int = 0


def _rerun(fragment_id: str = "") -> bytes:
    msg = BackMsg()
    msg.rerun_script.query_string = ""
    msg.rerun_script.page_script_hash = ""
    if fragment_id:
        msg.rerun_script.fragment_id = fragment_id
        msg.rerun_script.is_auto_rerun = True
    return msg.SerializeToString()


async def _auto_rerun(
    ws: ClientConnection, fragment_id: str, every_s: float, pending: list[float], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except TimeoutError:
            pending.append(time.perf_counter())
            await ws.send(_rerun(fragment_id))


async def one_session(url: str, stop: asyncio.Event, times: SessionTimes) -> None:
    """A browser tab on the server at `url` (http://host:port) until `stop` is set."""
    stream = url.replace("http://", "ws://").rstrip("/") + "/_stcore/stream"
    timers: dict[str, asyncio.Task[None]] = {}
    pending: list[float] = []  # NOTE: the send times of fragment reruns not yet settled, oldest first
    num_taken = 0  # NOTE: how many of them the server's run in progress answers (those sent before it started)
    async with connect(stream, subprotocols=[Subprotocol("streamlit")], max_size=None, open_timeout=60) as ws:
        opened = time.perf_counter()
        await ws.send(_rerun())
        page_done = False
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), timeout=0.5)
            except TimeoutError:
                continue
            msg = ForwardMsg()
            msg.ParseFromString(raw if isinstance(raw, bytes) else raw.encode())
            times.num_messages += 1
            kind = msg.WhichOneof("type")
            if kind == "auto_rerun" and msg.auto_rerun.fragment_id not in timers:
                timers[msg.auto_rerun.fragment_id] = asyncio.create_task(
                    _auto_rerun(ws, msg.auto_rerun.fragment_id, msg.auto_rerun.interval, pending, stop)
                )
            elif kind == "session_status_changed" and msg.session_status_changed.script_is_running:
                num_taken = len(pending)
            elif kind == "delta" and msg.delta.new_element.WhichOneof("type") == "exception":
                times.errors.append(msg.delta.new_element.exception.message)
            elif kind == "script_finished":
                now = time.perf_counter()
                if msg.script_finished not in FINISHED:
                    continue
                if not page_done:
                    times.page_s.append(now - opened)
                    page_done = True
                elif msg.script_finished == ForwardMsg.FINISHED_FRAGMENT_RUN_SUCCESSFULLY and num_taken:
                    times.refresh_s.append(now - pending[0])
                    del pending[:num_taken]
                    num_taken = 0
        for task in timers.values():
            task.cancel()


async def run_sessions(url: str, num_sessions: int, seconds: float) -> list[SessionTimes]:
    """`num_sessions` sessions on the server for `seconds`, opened together."""
    stop = asyncio.Event()
    times = [SessionTimes() for _ in range(num_sessions)]
    tasks = [asyncio.create_task(one_session(url, stop, t)) for t in times]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    return times
