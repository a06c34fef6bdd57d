"""No page's URL or link carries a database password. The link names a capture by its URL without the
password; the dashboard matches it to the capture it was given, whose password stays on the server side
(in the `--db` URL, or libpq's PGPASSWORD / ~/.pgpass when that URL has none).

The rule needs no server (the first test); the pages are read on a real PostgreSQL capture through a real
`streamlit run` (`make test-postgres`): every message the browser receives, on every page and after
following a link, is searched for the password."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from kvscope.dashboard import frame, launch
from kvscope.telemetry import link_name
from tests.dashboard.conftest import PAGES
from tests.dashboard.test_launch import _free_port, _healthy, _wait_until

LEAKY_RUN = ["--workload", "multi-turn", "--num-requests", "16", "--page-size", "4", "--kv-tokens", "2048"]
LEAKY_FAULTS = ["--inject", "leak-tail:0.3", "--inject", "lock-leak:0.2", "--inject-seed", "7"]


def test_a_link_names_a_url_capture_without_its_password_and_still_finds_it() -> None:
    given = "postgresql://kv:s3cret@db.example:5433/captures"
    assert link_name(given) == "postgresql://kv@db.example:5433/captures"
    assert link_name("runs/a b.db") == "runs/a b.db"
    options = frame.capture_options(given, [Path("runs/x.db")])
    assert frame._listed_as("postgresql://kv@db.example:5433/captures", options) == given
    assert frame._listed_as("postgresql://kv:s3cret@db.example:5433/captures", options) == given  # an old link
    assert frame._listed_as("postgresql://kv@db.example:5433/other", options) is None


class Seen:
    """What the browser received: every query string, every link's query string, every message's bytes."""

    def __init__(self) -> None:
        self.query_strings: list[str] = []
        self.links: list[str] = []
        self.messages: list[bytes] = []

    def rerun(self, session: ClientConnection, page: str, query_string: str = "") -> None:
        rerun = BackMsg()
        rerun.rerun_script.query_string = query_string
        rerun.rerun_script.page_name = page
        session.send(rerun.SerializeToString())
        reply = ForwardMsg()
        while reply.WhichOneof("type") != "script_finished":
            raw = session.recv(timeout=120)
            assert isinstance(raw, bytes)
            self.messages.append(raw)
            reply.ParseFromString(raw)
            self._read(reply)

    def _read(self, reply: ForwardMsg) -> None:
        if reply.WhichOneof("type") == "page_info_changed":
            self.query_strings.append(reply.page_info_changed.query_string)
        elif reply.WhichOneof("type") == "delta" and reply.delta.WhichOneof("type") == "new_element":
            element = reply.delta.new_element
            if element.WhichOneof("type") == "page_link":
                self.links.append(element.page_link.query_string)


def _leaky_capture(url: str) -> None:
    command = [sys.executable, "-m", "kvscope", "run", *LEAKY_RUN, *LEAKY_FAULTS, "--capture", url]
    done = subprocess.run(command, cwd=launch.ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stderr  # the injected leak fails the idle check


@pytest.mark.postgres
@pytest.mark.parametrize("held", ["in the --db URL", "in PGPASSWORD"])
def test_no_page_url_or_link_holds_the_database_password(postgres_url: str, held: str) -> None:
    _leaky_capture(postgres_url)
    password = str(make_url(postgres_url).password)
    given, env = postgres_url, dict(os.environ)
    if held == "in PGPASSWORD":
        given, env = link_name(postgres_url), {**env, "PGPASSWORD": password}
    port = _free_port()
    dashboard = subprocess.Popen(
        launch.dashboard_command(given, port), cwd=launch.ROOT, env=env, stdout=subprocess.DEVNULL
    )
    seen = Seen()
    try:
        assert _wait_until(lambda: _healthy(port), 90.0), "the dashboard never answered"
        with connect(
            f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=[Subprotocol("streamlit")], max_size=None
        ) as session:
            for page in PAGES:
                seen.rerun(session, page)
            assert seen.links, "the Leaks page showed no links"
            opened = len(seen.query_strings)
            seen.rerun(session, "requests", seen.links[0])  # follow the Leaks page's first link
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=30)
    assert seen.query_strings and all(password not in q for q in seen.query_strings + seen.links)
    assert not [m for m in seen.messages if password.encode() in m], "a message to the browser holds the password"
    assert all("capture=postgresql" in q for q in seen.links), seen.links
    followed = " ".join(seen.query_strings[opened:])
    assert "rid=" in followed and b"not one this dashboard lists" not in b"".join(seen.messages)
