"""`make run`: a served engine under load, and the dashboard watching it fill up, live.

    python -m kvscope.dashboard.launch [--workload multi-tenant] [--num-requests N] [--rate R]
                                       [--host 127.0.0.1] [--port 8501] [--serve-port 30000]
                                       [--runs-dir DIR | --capture URL] [--nice 0..19]

Starts `kvscope serve` on loopback recording `runs/<time>-live.db` (or the database `--capture`
names, e.g. a postgresql:// URL that other engines write into too), waits until it answers
/health, starts `kvscope load` against it (the multi-tenant workload through the official
openai client), then `streamlit run app.py -- --db <capture> --nice N` bound to 127.0.0.1 (unless
--host says otherwise), headless, at a lower scheduling priority than the engine (--nice, 10 unless
told; 0: off), with Streamlit's usage statistics off and its Deploy
button hidden. Ctrl-C (or SIGTERM, or the server or the dashboard ending: the launcher says which
one and how, its exit code or the signal that killed it) stops all three, waits for them, folds the
capture's log into it (one file: a dashboard still reading when the server closed it kept it in WAL
mode) and exits 0 after Ctrl-C so `make` prints no error
line. Streamlit's file watcher is off: it would watch the whole tree, .venv included, and
flood the terminal with "Inotify queue overflowed". Torch-free: the engine runs in the
server's scheduler process.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import IO

from kvscope.dashboard.priority import DEFAULT_NICE, MAX_NICE
from kvscope.telemetry.sqlite_files import settle_file
from kvscope.telemetry.store import display_name, file_of, is_url

ROOT = Path(__file__).resolve().parents[2]
WAIT_FOR_CAPTURE_S = 60.0
GRACE_S = 3.0  # a Ctrl-C at the terminal reaches every process of the group: give them time to close
STOP_TIMEOUT_S = 10.0
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8501
DEFAULT_SERVE_PORT = 30000
# NOTE: the same settings as .streamlit/config.toml, passed explicitly so they hold from any directory
STREAMLIT_SETTINGS = {
    "server.headless": "true",  # no browser launch and no first-run e-mail prompt on stdin
    "browser.gatherUsageStats": "false",
    "client.toolbarMode": "minimal",  # hides the Deploy button and the developer menu
    "server.fileWatcherType": "none",  # nothing to reload: the app's code does not change while it runs
}


def serve_command(capture: Path | str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvscope",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--capture",
        str(capture),
    ]


def load_command(port: int, workload: str, num_requests: int, rate: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvscope",
        "load",
        "--url",
        f"http://127.0.0.1:{port}",
        "--workload",
        workload,
        "--num-requests",
        str(num_requests),
        "--rate",
        str(rate),
        "--quiet",
    ]


def dashboard_command(
    capture: Path | str, port: int | None = None, host: str = DEFAULT_HOST, nice: int | None = None
) -> list[str]:
    server = [] if port is None else ["--server.port", str(port)]
    settings = [arg for key, value in STREAMLIT_SETTINGS.items() for arg in (f"--{key}", value)]
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(ROOT / "app.py"),
        "--server.address",
        host,
        *server,
        *settings,
        "--",
        "--db",
        str(capture),
        *([] if nice is None else ["--nice", str(nice)]),
    ]


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dashboard_healthy(url: str) -> bool:
    """Streamlit's own health check answers 200 at `url`."""
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@contextmanager
def dashboard_on(
    capture: Path | str, *, nice: int | None = None, log: IO[bytes] | None = None, start_timeout_s: float = 60.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The dashboard (dashboard_command) on `capture` at a free loopback port, for tests and benchmarks:
    yields (its URL, its process) once Streamlit's health check answers; stopped and reaped on the
    way out. RuntimeError when it ends, or stays silent for `start_timeout_s`, first."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    output = subprocess.DEVNULL if log is None else log
    server = subprocess.Popen(dashboard_command(capture, port, nice=nice), cwd=ROOT, stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not dashboard_healthy(url):
            if server.poll() is not None:
                raise RuntimeError(f"streamlit exited ({server.returncode}) before it served")
            if time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not answer on port {port} within {start_timeout_s:.0f} s")
            time.sleep(0.2)
        yield url, server
    finally:
        server.terminate()
        try:
            server.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def live_capture_path(runs_dir: Path, now: float | None = None) -> Path:
    return runs_dir / time.strftime("%Y%m%d-%H%M%S-live.db", time.localtime(now))


def _shown(capture: Path | str) -> str:
    """A file relative to the repository; a URL without its password."""
    if isinstance(capture, str):
        return display_name(capture)
    return str(capture.relative_to(ROOT)) if capture.is_relative_to(ROOT) else str(capture)


def say(line: str) -> None:
    print(f"kvscope: {line}", flush=True)


def _serving(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _wait_for(capture: Path | str, port: int, server: subprocess.Popen[bytes]) -> bool:
    """Until the server answers /health and its capture file exists (a database URL: the server
    made its run before it answers); False if it ended first."""
    path = file_of(capture)
    deadline = time.monotonic() + WAIT_FOR_CAPTURE_S
    while time.monotonic() < deadline:
        if (path is None or (path.exists() and path.stat().st_size > 0)) and _serving(port):
            return True
        if server.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Reap the process: it may be closing already (a terminal's Ctrl-C reaches it too); if not,
    SIGTERM (the engine closes its capture as interrupted), and SIGKILL as the last resort."""
    for ask in (None, process.terminate, process.kill):
        if ask is not None:
            ask()
        try:
            process.wait(timeout=GRACE_S if ask is None else STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--workload", default="multi-tenant", help="the generated workload the load sends")
    parser.add_argument("--num-requests", type=int, default=400, help="requests in the workload")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second the load sends")
    parser.add_argument("--serve-port", type=int, default=DEFAULT_SERVE_PORT, help="port the server listens on")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address the dashboard listens on (0.0.0.0: every one)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port the dashboard listens on")
    parser.add_argument(
        "--nice",
        type=int,
        choices=range(MAX_NICE + 1),
        metavar=f"0..{MAX_NICE}",
        default=DEFAULT_NICE,
        help="the dashboard's scheduling niceness, so the engine gets the CPU first (0: off)",
    )
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs", help="folder of the new capture")
    parser.add_argument(
        "--capture",
        metavar="URL",
        help="record into this capture (a database URL such as postgresql://..., or a file) instead of a new file",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    capture: Path | str = live_capture_path(args.runs_dir.resolve()) if not args.capture else args.capture
    if isinstance(capture, str) and not is_url(capture):
        capture = Path(capture).resolve()
    if isinstance(capture, Path):
        capture.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting kvscope serve on http://127.0.0.1:{args.serve_port}, recording {_shown(capture)}")
    server = subprocess.Popen(serve_command(capture, args.serve_port), cwd=ROOT)
    load: subprocess.Popen[bytes] | None = None
    dashboard: subprocess.Popen[bytes] | None = None
    try:
        if not _wait_for(capture, args.serve_port, server):
            print(f"kvscope: error: kvscope serve did not start serving on port {args.serve_port}", file=sys.stderr)
            return 1
        say(f"sending the {args.workload} workload at {args.rate:g} requests/s")
        load = subprocess.Popen(load_command(args.serve_port, args.workload, args.num_requests, args.rate), cwd=ROOT)
        say(f"starting the dashboard on http://{args.host}:{args.port} (Ctrl-C stops all three)")
        dashboard = subprocess.Popen(dashboard_command(capture, args.port, args.host, args.nice), cwd=ROOT)
        return _wait_any({"the dashboard": dashboard, "kvscope serve": server})
    except KeyboardInterrupt:
        say("stopping the load, the dashboard and the server")
        return 0  # a Ctrl-C is how this is meant to end: no error line from make
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        for process in (load, dashboard, server):
            if process is not None:
                _stop(process)
        if isinstance(capture, Path) and capture.exists():
            settle_file(capture)
        say(f"stopped; the capture is {_shown(capture)}")


def _wait_any(processes: dict[str, subprocess.Popen[bytes]]) -> int:
    """Until one of them ends: says which one and how, and returns its exit code (1 for one
    killed by a signal: make then reports a failure, not a status of 245)."""
    while True:
        for name, process in processes.items():
            if process.poll() is not None:
                print(f"kvscope: error: {name} {ended_how(process.returncode)}; stopping the rest", file=sys.stderr)
                return process.returncode if process.returncode >= 0 else 1
        time.sleep(0.5)


def ended_how(returncode: int) -> str:
    """'exited with code 2', 'was killed by SIGSEGV (signal 11)'."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by {name} (signal {-returncode})"


if __name__ == "__main__":
    sys.exit(main())
