"""The probe in a vLLM 0.32 server that is never idle: a soak of continuous traffic with faults
injected mid-way by the test-only plugin (tests/engines/faults), under `kvscope instrument`, with
the busy census and the lingering bounds set small.

Two server lives, started together (the second waits idle while the first soaks) and after the
shared server's phases (tests/engines/conftest.py ranks this module last):
  life 1  API_SERVERS API servers; SOAK_S of traffic at fixed concurrency; at 40% blocks taken
          outside any block table (kvsfault-stray), at 50% a prefix hit without a reference
          (kvsfault-noref), at 60% an aborted request that keeps its blocks (kvsfault-linger);
          then SIGTERM once the last requests were answered: the drain's census closes the run
  life 2  a double free on the preemption path (kvsfault-pdfree), the fault that kills the
          EngineCore through vLLM's own assert: traffic until it dies
Each test below checks one promise on what the lives stored (the lives run once, in a module
fixture). Run by `make test-engines`; 11 to 14.5 minutes here at a load of 13 to 28 on 2 cores, server
starts included (life 1's two API servers were up in 3.5 minutes, life 2's one in 2.5, started together).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from tests.engines.conftest import FAULTS_DIR, ROOT
from tests.engines.soak_traffic import completion_body
from tests.engines.vllm_server import READY_TIMEOUT_S, VLLM_PYTHON, VllmServer, vllm_server

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    ),
]

SOAK_S = 300.0  # the bound: at least 5 minutes never idle
# NOTE: never idle on a loaded 2-core machine. The engine runs dry only when the API server hands it nothing
# for as long as the work it holds lasts: vLLM's API server, starved of CPU, stalls for seconds at times (it
# once handed back nothing for 7 s, then 14 requests at once). Short requests alone (6 to 16 clients of up to
# 256 tokens) left 2 to 7 idle moments in 5 minutes; two anchors streaming 460 and 380 tokens (about 2 s
# each), sent again only once they ended, left 38 idle censuses in 59,000 steps run alone at load 5 (where the
# two ended close together). Now the clients run in a process of their own (soak_traffic.py, pytest's GIL
# aside) and each anchor is a relay of ANCHOR_TOKENS-long requests in contexts of MAX_MODEL_LEN, the next sent
# at the last one's half-way point: the engine always holds an anchor with half its tokens or more to decode
# (about 2,000 steps, seconds at any step rate seen here), however late the API server hands over the next.
CONCURRENCY = 14  # NOTE: short clients, beside the anchors
ANCHOR_TOKENS = (4000, 3600)  # NOTE: one relay per length (soak_traffic.py)
MAX_MODEL_LEN = 4096  # NOTE: the soak's model's max_position_embeddings (vllm_server's context_tokens)
NUM_BLOCKS = 512  # NOTE: 511 usable: each relay's two requests (up to 189 blocks) and 14 of 5 to 8 blocks
API_SERVERS = 2  # NOTE: vLLM's --api-server-count: Prometheus scrapes the series of several API servers
CRASH_CLIENTS = 16
CRASH_NUM_BLOCKS = 48  # life 2 (contexts of 256): a pool the traffic overflows at once, so vLLM preempts soon
# NOTE: life 2's census runs every CRASH_CENSUS_EVERY_STEPS: vLLM handed a double-freed block out again 6, 29
# and more steps after the fault here (the sooner, the smaller the pool), and the census must come first
CRASH_CENSUS_EVERY_STEPS = 2
CENSUS_EVERY_STEPS = 8
CENSUS_EVERY_S = 1.0
LINGER_STEPS = 16
LINGER_S = 2.0
PROBE_ENV = {
    "KVSCOPE_CENSUS_EVERY_STEPS": str(CENSUS_EVERY_STEPS),
    "KVSCOPE_CENSUS_EVERY_S": str(CENSUS_EVERY_S),
    "KVSCOPE_LINGER_STEPS": str(LINGER_STEPS),
    "KVSCOPE_LINGER_S": str(LINGER_S),
}
# NOTE: the bound is in time. A busy census is due CENSUS_EVERY_STEPS steps or CENSUS_EVERY_S after the last,
# but the probe also waits 100 times the last census's own time (its 1% budget): at 100 steps a second here a
# census every 8 steps was not there for 119 steps. Twice the period, and 2 s for the recorder's hand-off (0.2 s)
# and a loaded machine's stalls (a linger named 5.01 s after its fault against a bound of 5 s)
CENSUS_DUE_S = 2 * CENSUS_EVERY_S + 1.0  # NOTE: a busy census runs within this of any moment of a busy stretch
CENSUS_BOUND_S = CENSUS_DUE_S + 1.0  # NOTE: and is stored within this
WARM_TIMEOUT_S = 180.0  # NOTE: each short client's first answer, before the soak's 5 minutes begin
# NOTE: the soak's steps, at least (its length is in time): at a load of 5 on 2 cores 59,000 steps ran in its
# 5 minutes, at a load of 28 only 942 (3 a second: torch's threads on an overloaded machine), still never idle
MIN_SOAK_STEPS = 300
MAX_ERROR_SHARE = 0.01  # NOTE: transport errors (a connection the server closed under the client), of the answers
FAULT_AT = {"stray": 0.4, "noref": 0.5, "linger": 0.6}  # fractions of SOAK_S
INJECT_TIMEOUT_S = 60.0
CRASH_TIMEOUT_S = 150.0
RULES = ROOT / "deploy" / "prometheus" / "kvscope-alerts.yml"  # helper alerts' rule file
LEAK_ALERT = "KvscopeKVBlocksLeaked"


# -- what a capture stored ---------------------------------------------------------------------


class NamedBlock(NamedTuple):
    step: int
    t_mono: float  # when the recorder stored the census (the capture's clock: the system's monotonic one)
    census: str  # busy / idle / drain / poll (see census_kinds)
    term: str
    block: int
    text: str  # what the census says of this block: its counts and who holds, took or released it


def named_blocks(capture: Path) -> list[NamedBlock]:
    """Every block a stored census of the capture's last run named (census_blocks: every one, where the
    check's one-line message names a few), with what it said of it: the message's words for the block
    where it names it, and the stored taker and releaser (the requests named and the events)."""
    kinds = census_kinds(capture)
    said: dict[tuple[int, str, int], str] = {}
    times: dict[int, float] = {}
    for step, t, term, message in query(
        capture, "SELECT step, t_mono, pool, message FROM leak_checks WHERE run_id = ? AND NOT ok"
    ):
        times[int(step)] = float(t)
        for match in re.finditer(r"block (\d+)\b(.*?)(?=; block \d+\b| \(\+\d+ more\)|$)", message or ""):
            said[(int(step), str(term), int(match[1]))] = match[2]
    named = []
    for step, term, block, taker, taker_event, releaser, releaser_event in query(
        capture,
        "SELECT step, term, block, taker_rid, taker_event, releaser_rid, releaser_event FROM census_blocks "
        "WHERE run_id = ?",
    ):
        stored = f"; taker {taker} ({taker_event}); releaser {releaser} ({releaser_event})"
        text = said.get((int(step), str(term), int(block)), "") + stored
        named.append(NamedBlock(int(step), times.get(int(step), 0.0), kinds.get(int(step), "idle"), term, block, text))
    return named


def census_kinds(capture: Path) -> dict[int, str]:
    """Each stored census's step -> busy / idle / drain / poll: leak_checks.census where the probe
    stores it; else read from the engine's usage at that step (requests running or waiting: busy)."""
    columns = {row[1] for row in query(capture, "PRAGMA table_info(leak_checks)", run=False)}
    if "census" in columns:
        rows = query(capture, "SELECT DISTINCT step, census FROM leak_checks WHERE run_id = ?")
        return {int(step): str(kind) for step, kind in rows}
    rows = query(
        capture,
        "SELECT DISTINCT c.step, u.num_running + u.num_waiting FROM leak_checks c LEFT JOIN usage u "
        "ON u.run_id = c.run_id AND u.step = c.step WHERE c.run_id = ?",
    )
    return {int(step): "busy" if (active or 0) > 0 else "idle" for step, active in rows}


def query(capture: Path, sql: str, run: bool = True) -> list[tuple[Any, ...]]:
    """Rows of `sql` on the capture (its `?` is the last run's id when `run`)."""
    conn = sqlite3.connect(capture)
    try:
        if not run:
            return conn.execute(sql).fetchall()
        ((last,),) = conn.execute("SELECT max(id) FROM runs").fetchall()
        return conn.execute(sql, (last,)).fetchall()
    finally:
        conn.close()


def run_status(capture: Path) -> tuple[str, str | None]:
    ((status, error),) = query(capture, "SELECT status, error FROM runs WHERE id = ?")
    return str(status), error


def step_at(capture: Path, mono: float) -> int:
    """The first engine step that began at or after the monotonic time `mono`."""
    rows = query(capture, "SELECT min(step) FROM usage WHERE run_id = ? AND t_mono >= " + repr(float(mono)))
    return int(rows[0][0]) if rows and rows[0][0] is not None else 1 << 30


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )


def injected(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# -- traffic ---------------------------------------------------------------------------------


@dataclass
class Load:
    """The clients of tests/engines/soak_traffic.py, in a process of their own: `clients` short ones
    (96 to 150 output tokens) and one anchor relay per length of `anchors`. `rid_prefix`: their
    X-Request-Id (a fault marker selects them)."""

    server: VllmServer
    rid_prefix: str
    seed: int
    log: Path  # NOTE: the process's JSON lines (soak_traffic's doc)
    min_tokens: int = 96
    max_tokens: int = 150
    anchors: tuple[int, ...] = ()
    clients: int = CONCURRENCY
    process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        config = {
            "url": self.server.url,
            "model": self.server.model,
            "rid_prefix": self.rid_prefix,
            "seed": self.seed,
            "clients": self.clients,
            "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "anchor_tokens": list(self.anchors),
        }
        command = [sys.executable, "-m", "tests.engines.soak_traffic", json.dumps(config), str(self.log)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, cwd=ROOT, text=True)

    def lines(self) -> list[dict[str, Any]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    @property
    def done(self) -> list[tuple[float, int]]:
        """(monotonic time, status code) of each answer."""
        return [(line["t"], line["status"]) for line in self.lines() if "status" in line]

    @property
    def errors(self) -> list[tuple[float, str]]:
        return [(line["t"], line["error"]) for line in self.lines() if "error" in line]

    def warming(self) -> bool:
        """Some short client (not an anchor) has had no answer yet."""
        answered = {line["client"] for line in self.lines() if "status" in line and line["client"] < self.clients}
        return len(answered) < self.clients

    def stop(self, timeout_s: float = 30.0) -> None:
        """No more requests; returns once the anchors' streams are closed (the short clients' last
        requests still run) or the process ended."""
        assert self.process is not None and self.process.stdin is not None
        if not self.process.stdin.closed:
            self.process.stdin.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if any("anchors_closed" in line for line in self.lines()):
                return
            time.sleep(0.1)

    def finish(self) -> None:
        if self.process is None:
            return
        self.stop()
        try:
            self.process.wait(140)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    @contextmanager
    def running(self) -> Iterator[Load]:
        self.start()
        try:
            yield self
        finally:
            self.finish()


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(count)]


def complete(server: VllmServer, rid: str, prompt: list[int], max_tokens: int) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions",
        headers={"X-Request-Id": rid},
        json=completion_body(server.model, prompt, max_tokens),
        timeout=300,
    )
    assert response.status_code == 200, response.text


def first_chunk(server: VllmServer, rid: str, prompt: list[int], max_tokens: int, then_abort: bool) -> None:
    """A streamed completion: returns once its first token arrived (its prompt is computed and
    cached), closing the stream there when `then_abort` (vLLM aborts a request whose client left),
    else reading it to its end in the background."""

    def read(keep: threading.Event) -> None:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            headers={"X-Request-Id": rid},
            json=completion_body(server.model, prompt, max_tokens, stream=True),
            timeout=300,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    keep.set()
                    if then_abort:
                        return

    first = threading.Event()
    thread = threading.Thread(target=read, args=(first,), daemon=True)
    thread.start()
    assert first.wait(120), f"no first token for {rid}"
    if then_abort:
        thread.join(30)


def wait_for_fault(log: Path, fault: str, timeout_s: float = INJECT_TIMEOUT_S) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [f for f in injected(log) if f["fault"] == fault]
        if found:
            return found[0]
        time.sleep(0.2)
    return None


# -- the two lives ---------------------------------------------------------------------------


@dataclass
class Soak:
    capture: Path  # life 1
    faults_log: Path
    log: Path
    started_mono: float = 0.0
    ended_mono: float = 0.0  # the last request of the soak's traffic before the drain
    requests: list[int] = field(default_factory=list)  # the status codes of the soak's traffic (its drain aside)
    errors: list[str] = field(default_factory=list)
    prometheus: dict[str, Any] | None = None  # what a real Prometheus saw while the faults stood (None: no helper)
    api_servers: list[str] = field(default_factory=list)  # life 1's API server processes, by their titles
    crash_capture: Path | None = None  # life 2
    crash_faults_log: Path | None = None
    crash_log: Path | None = None
    crash_seen: bool = False  # the server stopped answering after the double free
    crash_live: list[Any] = field(default_factory=list)  # GET /kvscope/census after the double free, until it died


def instrumented(
    tmp: Path, name: str, every_steps: int = CENSUS_EVERY_STEPS
) -> tuple[dict[str, str], tuple[str, ...], Path, Path]:
    capture, faults_log = tmp / f"{name}.db", tmp / f"{name}-faults.jsonl"
    path = ":".join((str(FAULTS_DIR), str(ROOT)))
    env = {
        "PYTHONPATH": path,
        "VLLM_PLUGINS": "kvscope,kvscope_test_faults",
        "KVSCOPE_TEST_FAULTS_LOG": str(faults_log),
        **PROBE_ENV,
        "KVSCOPE_CENSUS_EVERY_STEPS": str(every_steps),
    }
    wrap = (sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--")
    return env, wrap, capture, faults_log


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> Soak:
    tmp = tmp_path_factory.mktemp("vllm-soak")
    env, wrap, capture, faults_log = instrumented(tmp, "soak")
    crash_env, crash_wrap, crash_capture, crash_faults_log = instrumented(tmp, "crash", CRASH_CENSUS_EVERY_STEPS)
    result = Soak(capture, faults_log, tmp / "soak.log", crash_capture=crash_capture, crash_faults_log=crash_faults_log)
    result.crash_log = tmp / "crash.log"
    second = vllm_server(
        wrap=crash_wrap,
        env=crash_env,
        log_path=result.crash_log,
        num_blocks=CRASH_NUM_BLOCKS,
        kv_events=False,
        args=STOP,
    )
    with ThreadPoolExecutor(1) as starter, ExitStack() as lives:
        starting = starter.submit(second.__enter__)  # NOTE: both start at once; the second waits idle meanwhile
        lives.callback(stop_when_started, second, starting)
        load: Load | None = None
        try:
            with vllm_server(
                wrap=wrap,
                env=env,
                log_path=result.log,
                num_blocks=NUM_BLOCKS,
                kv_events=False,
                args=(*DRAIN_STOP, "--max-model-len", str(MAX_MODEL_LEN)),  # NOTE: vLLM's last value wins
                api_servers=API_SERVERS,
                context_tokens=MAX_MODEL_LEN,
            ) as server:
                load = Load(server, "soak", seed=1, log=tmp / "soak-traffic.jsonl", anchors=ANCHOR_TOKENS)
                soak_life(server, load, result)
        finally:
            if load is not None:
                load.finish()
        result.requests = [code for t, code in load.done if t < result.ended_mono]
        result.errors = [err for t, err in load.errors if t < result.ended_mono]
        crash_life(starting.result(timeout=READY_TIMEOUT_S), result)
    return result


STOP = ("--shutdown-timeout", "10")  # NOTE: vLLM's default 0 kills the EngineCore before the probe closes its run
# NOTE: life 1's stop. With one API server it drained 16 requests of up to 150 tokens: at 7 steps a second (a
# load of 13 on 2 cores here) they outlasted 10 s, vLLM killed the EngineCore mid-drain and the run closed
# crashed, with no drain census. With several, nothing is in flight, but the launcher's one deadline covers
# the API servers' and the EngineCore's exits on a loaded machine
DRAIN_STOP = ("--shutdown-timeout", "60")


def stop_when_started(server: Any, starting: Future[VllmServer]) -> None:
    """The second server's end: once its start ended, stop it if it started."""
    with suppress(Exception):
        starting.result(timeout=READY_TIMEOUT_S)
        server.__exit__(None, None, None)


def soak_life(server: VllmServer, load: Load, result: Soak) -> None:
    """SOAK_S of traffic, the faults mid-way; the clients stop sending, and once their last requests
    were answered the server gets SIGTERM. (With several API servers vLLM 0.32 does not drain requests
    in flight: each API server stops its engine client at once, their requests are never answered,
    and once --shutdown-timeout ran out vLLM kills every process, the EngineCore with no census.)
    The soak begins once each short client had an answer (while Prometheus starts): a fresh API server
    once handed back no answer for 7 s while the engine ended its first requests (idle 11 s into the
    traffic). Not the anchors' first answers: at 3 steps a second here they took 172 s."""
    load.start()
    with prometheus_watching(server) as prom:
        deadline = time.monotonic() + WARM_TIMEOUT_S
        while load.warming() and time.monotonic() < deadline:
            time.sleep(0.2)
        result.started_mono = time.monotonic()
        result.api_servers = api_server_processes(server.pid)
        for fault, at in FAULT_AT.items():
            time.sleep(max(0.0, result.started_mono + at * SOAK_S - time.monotonic()))
            INJECT[fault](server, result.faults_log)
        time.sleep(max(0.0, result.started_mono + SOAK_S - time.monotonic()))
        if prom is not None:
            result.prometheus = prom()
    result.ended_mono = time.monotonic()
    load.finish()
    stop_gracefully(server)


def api_server_processes(pid: int) -> list[str]:
    """The titles of `pid`'s children that vLLM named as API servers (VLLM::APIServer_<index>)."""
    titles = []
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    for child in children:
        with suppress(OSError):
            title = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode()
            if title.startswith("VLLM::APIServer"):
                titles.append(title)
    return sorted(titles)


def stop_gracefully(server: VllmServer, timeout_s: float = 90.0) -> None:
    """SIGTERM to the server's main process alone (the API server; with several, vLLM's launcher), as a
    service manager stops it: vLLM drains what is in flight (with one API server only), then shuts its
    engine down (a normal shutdown: the drain census, the run finished). A signal to the whole process
    group, as the server fixture's stop and a terminal's Ctrl-C send, reaches vLLM's workers too: the
    step in flight fails and the run closes interrupted, with no drain census."""
    os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "Z":  # NOTE: exited; the fixture reaps it
            return
        time.sleep(0.5)


def inject_stray(server: VllmServer, log: Path) -> None:
    complete(server, "kvsfault-stray-1", tokens(random.Random(41), 70), max_tokens=40)
    assert wait_for_fault(log, "stray"), "kvsfault-stray injected nothing"


def inject_noref(server: VllmServer, log: Path) -> None:
    """A long request's prompt is cached and in use; a second with the same 96-token prefix hits it
    (a retry with fresh ids when the first's blocks were evicted before the hit)."""
    rng = random.Random(43)
    for attempt in range(3):
        prefix = tokens(rng, 96)
        # NOTE: long (contexts of 512): the hit's stretch must outlast the census's bound in time
        first_chunk(server, f"soak-noref-base-{attempt}", prefix + tokens(rng, 16), 380, then_abort=False)
        complete(server, f"kvsfault-noref-{attempt}", prefix + tokens(rng, 16), max_tokens=380)
        if wait_for_fault(log, "noref", timeout_s=5.0):
            assert wait_for_fault(log, "noref-ended"), "the unreferenced hit's request never freed its blocks"
            return
    raise AssertionError("kvsfault-noref injected nothing in 3 tries (no prefix hit)")


def inject_linger(server: VllmServer, log: Path) -> None:
    rng = random.Random(47)
    for attempt in range(3):
        first_chunk(server, f"kvsfault-linger-{attempt}", tokens(rng, 70), 150, then_abort=True)
        if wait_for_fault(log, "linger", timeout_s=10.0):
            return
    raise AssertionError("kvsfault-linger injected nothing in 3 tries (no abort reached the engine)")


INJECT: dict[str, Callable[[VllmServer, Path], None]] = {
    "stray": inject_stray,
    "noref": inject_noref,
    "linger": inject_linger,
}


def crash_life(server: VllmServer, result: Soak) -> None:
    """Traffic whose every request carries the marker: the first preemption double-frees; traffic
    goes on until the EngineCore's assert ends the server (or CRASH_TIMEOUT_S)."""
    assert result.crash_faults_log is not None
    log = result.crash_faults_log.with_name("crash-traffic.jsonl")
    # NOTE: long requests: they preempt
    load = Load(server, "kvsfault-pdfree", seed=2, log=log, min_tokens=100, max_tokens=150, clients=CRASH_CLIENTS)
    with load.running():
        fault = wait_for_fault(result.crash_faults_log, "preempt-double-free", timeout_s=CRASH_TIMEOUT_S)
        deadline = time.monotonic() + CRASH_TIMEOUT_S
        while fault is not None and time.monotonic() < deadline and not result.crash_seen:
            try:
                result.crash_seen = httpx.get(f"{server.url}/health", timeout=5).status_code != 200
                live = httpx.get(f"{server.url}/kvscope/census", timeout=5)
                if live.status_code == 200:
                    result.crash_live.append(live.json())
            except httpx.HTTPError:
                result.crash_seen = True
            time.sleep(0.2)


@contextmanager
def prometheus_watching(server: VllmServer) -> Iterator[Callable[[], dict[str, Any]] | None]:
    """A real Prometheus scraping the server every second with the repository's alert rules, when
    helper alerts' tests/engines/prometheus.py is there; yields what it saw (call it while the
    faults stand), or None without it."""
    try:
        from tests.engines.prometheus import prometheus_server
    except ImportError:
        yield None
        return
    with prometheus_server([server.url.removeprefix("http://")], [RULES], scrape_interval_s=1.0) as prom:

        def seen() -> dict[str, Any]:
            prom.wait_for("kvscope_probe_leaked_blocks > 0", timeout_s=60)
            deadline = time.monotonic() + 60
            alerts: list[Any] = []
            while time.monotonic() < deadline:
                alerts = [a for a in prom.alerts() if a["labels"].get("alertname") == LEAK_ALERT]
                if any(a["state"] == "firing" for a in alerts):
                    break
                time.sleep(1.0)
            return {"leaked": prom.query("kvscope_probe_leaked_blocks"), "alerts": alerts}

        yield seen


# -- the checks ------------------------------------------------------------------------------


def fault_named(
    capture: Path, fault: dict[str, Any], terms: set[str], bound_s: float, context: str = ""
) -> list[NamedBlock]:
    """The first census at or after the fault's step that names every block of the fault under
    one of `terms`, each with the fault's request (or 'unknown', the census's reason with it),
    stored no later than `bound_s` after the fault; its rows for those blocks."""
    by_step: dict[int, list[NamedBlock]] = {}
    for named in named_blocks(capture):
        if named.step >= fault["step"] and named.term in terms and named.block in fault["blocks"]:
            by_step.setdefault(named.step, []).append(named)
    for step in sorted(by_step):
        rows = by_step[step]
        if {n.block for n in rows} == set(fault["blocks"]):
            late = rows[0].t_mono - fault["mono"]
            assert late <= bound_s, (
                f"named {late:.1f} s ({step - fault['step']} steps) after {fault}; bound {bound_s} s"
            )
            for n in rows:
                assert fault["rid"] in n.text or "unknown" in n.text, (n, fault)
            return rows
    raise AssertionError(f"no stored census named {fault}: {sorted(by_step.items())[:3]} {context}")


def test_the_server_is_never_idle_throughout_the_soak(soak: Soak) -> None:
    """SOAK_S of continuous traffic, every answer a 200, and the engine never out of work from the soak's
    first step to its last: no idle census (the probe runs one at every busy -> idle edge, vLLM's
    _notify_idle_state_callbacks) and no step that ended with nothing running or waiting."""
    assert soak.ended_mono - soak.started_mono >= SOAK_S >= 300
    assert set(soak.requests) == {200}, set(soak.requests)
    assert len(soak.errors) <= MAX_ERROR_SHARE * len(soak.requests), soak.errors[:3]
    first, last = step_at(soak.capture, soak.started_mono), step_at(soak.capture, soak.ended_mono) - 1
    assert last - first > MIN_SOAK_STEPS, (first, last)
    idle = query(
        soak.capture,
        "SELECT DISTINCT step FROM leak_checks WHERE run_id = ? AND census = 'idle'"
        f" AND step BETWEEN {first} AND {last}",
    )
    assert idle == [], f"{len(idle)} idle censuses, at steps {idle[:10]} of {first}..{last}"
    empty = query(
        soak.capture,
        f"SELECT step FROM usage WHERE run_id = ? AND step BETWEEN {first} AND {last}"
        " AND num_running + num_waiting = 0",
    )
    assert empty == [], f"the engine ran out of requests at {len(empty)} steps: {empty[:10]} of {first}..{last}"


def test_busy_censuses_before_the_first_fault_are_all_clean(soak: Soak) -> None:
    """Depends on helper busy (the periodic census while busy)."""
    first_fault = min(f["step"] for f in injected(soak.faults_log))
    kinds = census_kinds(soak.capture)
    busy = [s for s, kind in kinds.items() if kind == "busy" and s < first_fault]
    assert len(busy) >= 20, f"{len(busy)} busy censuses before step {first_fault}: {sorted(kinds.items())[:10]}"
    failed = query(
        soak.capture,
        f"SELECT step, pool, message FROM leak_checks WHERE run_id = ? AND step < {first_fault} AND NOT ok",
    )
    assert failed == [], failed[:5]


def test_blocks_taken_outside_any_block_table_are_named(soak: Soak) -> None:
    """kvsfault-stray: leaked, named at the next busy census (main names them at idle points only)."""
    [fault] = [f for f in injected(soak.faults_log) if f["fault"] == "stray"]
    rows = fault_named(soak.capture, fault, {"leaked"}, CENSUS_BOUND_S)
    assert all(n.census == "busy" for n in rows), rows


def test_a_prefix_hit_without_a_reference_is_named_with_its_request(soak: Soak) -> None:
    """kvsfault-noref: lostref while its request holds the blocks, named with that request, not
    the block's last releaser (helper busy). Each hit of the request (its first, one after each
    preemption) starts a stretch that its next free ends; a busy census falls in every stretch
    longer than the census's period. Every stretch that holds a stored busy census is checked, and one
    must (how long a stretch lasts in seconds is the machine's decode speed: 386 steps took under 3 s)."""
    windows = noref_windows(soak.faults_log)
    busy = [step for step, kind in census_kinds(soak.capture).items() if kind == "busy"]
    held = [(hit, end) for hit, end in windows if any(hit["step"] <= step < end["step"] for step in busy)]
    assert held, f"no stretch held a busy census: {[(h['step'], e['step']) for h, e in windows]}"
    for hit, end in held:
        rows = fault_named(soak.capture, hit, {"lostref"}, CENSUS_BOUND_S)
        assert rows[0].step < end["step"], (rows, end)
        assert all(hit["rid"] in n.text and n.census == "busy" for n in rows), rows


def noref_windows(log: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each unreferenced hit with the free that ended it (a request's lines alternate)."""
    found = [f for f in injected(log) if f["fault"] in ("noref", "noref-ended")]
    pairs = []
    for rid in {f["rid"] for f in found}:
        lines = [f for f in found if f["rid"] == rid]
        pairs += list(zip(lines[0::2], lines[1::2], strict=True))
    return pairs


def test_an_aborted_request_that_keeps_its_blocks_is_named_lingering(soak: Soak) -> None:
    """kvsfault-linger: `lingered`, named with the aborted request, once it lingered past both
    bounds, and the request stored as aborted (helper busy)."""
    [fault] = [f for f in injected(soak.faults_log) if f["fault"] == "linger"]
    # NOTE: the first step at or after LINGER_STEPS: a busy census takes a step number of its own, with no
    # usage row (here step 1298, 16 after the fault, was one, and the bound fell back to the fault's time)
    ((past_steps,),) = query(
        soak.capture, f"SELECT min(t_mono) FROM usage WHERE run_id = ? AND step >= {fault['step'] + LINGER_STEPS}"
    )
    past_both = max(past_steps if past_steps is not None else fault["mono"], fault["mono"] + LINGER_S)
    rows = fault_named(soak.capture, fault, {"lingered"}, past_both - fault["mono"] + CENSUS_BOUND_S)
    assert all(fault["rid"] in n.text and n.census == "busy" for n in rows), rows
    # NOTE: the request arrived, so it has a row, with its status, though its blocks were never freed
    stored = query(soak.capture, f"SELECT status FROM requests WHERE run_id = ? AND rid = '{fault['rid']}'")
    assert stored == [("aborted",)], stored


def test_the_drain_census_closes_the_run_and_names_what_still_stands(soak: Soak) -> None:
    """SIGTERM after the traffic: a census after the engine's last step (helper busy: at the drain),
    naming the blocks still kept (stray, linger); the run is finished and a leak."""
    assert run_status(soak.capture)[0] == "finished", soak.log.read_text()[-3000:]
    ((last_usage,),) = query(soak.capture, "SELECT max(step) FROM usage WHERE run_id = ?")
    ((last_census,),) = query(soak.capture, "SELECT max(step) FROM leak_checks WHERE run_id = ?")
    assert last_census >= last_usage, (last_census, last_usage)
    kinds = census_kinds(soak.capture)
    if "drain" in kinds.values() or "busy" in kinds.values():  # NOTE: a probe that stores its census's kind
        assert kinds[last_census] == "drain", sorted(kinds.items())[-5:]
    last = {(n.term, n.block) for n in named_blocks(soak.capture) if n.step == last_census}
    for fault in injected(soak.faults_log):
        if fault["fault"] == "stray":
            assert {("leaked", b) for b in fault["blocks"]} <= last, last
        if fault["fault"] == "linger":
            assert {("lingered", b) for b in fault["blocks"]} <= last, last
    check = kvscope("check", str(soak.capture))
    assert check.returncode == 1, check.stdout + check.stderr


def test_a_double_free_on_preemption_is_named_before_it_kills_the_engine(soak: Soak) -> None:
    """kvsfault-pdfree: lostref named with the preempted request by a busy census before vLLM's
    assert ends the EngineCore, or by the crash census when no busy census ran after the fault (the
    engine died first); the run closes `crashed` with the error's line (helper crash) and `kvscope
    check` says leak."""
    assert soak.crash_capture is not None and soak.crash_faults_log is not None and soak.crash_log is not None
    faults = [f for f in injected(soak.crash_faults_log) if f["fault"] == "preempt-double-free"]
    assert len(faults) == 1, (faults, soak.crash_log.read_text()[-3000:])
    assert soak.crash_seen, f"the engine lived on after the double free: {soak.crash_log.read_text()[-2000:]}"
    live = [engine.get("lostref") for answer in soak.crash_live for engine in answer]  # NOTE: what was live to see
    rows = fault_named(soak.crash_capture, faults[0], {"lostref"}, CENSUS_BOUND_S, f"(live censuses: {live})")
    if rows[0].census != "busy":  # NOTE: vLLM handed a double-freed block out again in the fault's own step here
        busy = [s for s, kind in census_kinds(soak.crash_capture).items() if kind == "busy"]
        missed = [s for s in busy if faults[0]["step"] <= s < rows[0].step]
        assert rows[0].census == "crash" and not missed, (rows, missed)
    status, error = run_status(soak.crash_capture)
    assert status == "crashed" and error and "ref_cnt" in error, (status, error)
    check = kvscope("check", str(soak.crash_capture))
    assert check.returncode == 1, check.stdout + check.stderr


def test_the_leak_gauge_and_its_alert_fire_on_a_real_prometheus_scrape(soak: Soak) -> None:
    """Prometheus (Debian's package, on loopback) scraped life 1, a server of API_SERVERS API server
    processes on one port, with the repository's rules: the leak gauge reads the stray blocks and the
    leak alert fires (helper alerts' prometheus.py and rule file)."""
    assert soak.api_servers == [f"VLLM::APIServer_{i}" for i in range(API_SERVERS)], soak.api_servers
    assert soak.prometheus is not None, "tests/engines/prometheus.py (helper alerts) is not in this tree"
    leaked = {s["metric"].get("term"): float(s["value"][1]) for s in soak.prometheus["leaked"]}
    assert leaked.get("leaked", 0) >= 2, leaked
    assert any(a["state"] == "firing" for a in soak.prometheus["alerts"]), soak.prometheus["alerts"]
