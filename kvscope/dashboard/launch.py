"""`make run`: record a paced workload in the background and open the dashboard on it, live.

    python -m kvscope.dashboard.launch [--num-requests N] [--pace RATE] [--workload NAME]
                                       [--host 127.0.0.1] [--port 8501] [--runs-dir DIR]

Starts `kvscope run … --capture runs/<time>-live.db`, waits for the capture to exist, then
runs `streamlit run app.py -- --db <capture>` bound to 127.0.0.1 (unless --host says
otherwise), headless, with Streamlit's usage statistics off and its Deploy button hidden.
Ctrl-C (or SIGTERM, or either process ending badly) stops both, waits for them, and exits 0
after Ctrl-C so `make` prints no error line. Torch-free: the engine runs in its own process.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[2]
WAIT_FOR_CAPTURE_S = 60.0
GRACE_S = 3.0  # a Ctrl-C at the terminal reaches every process of the group: give them time to close
STOP_TIMEOUT_S = 10.0
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8501
# NOTE: the same settings as .streamlit/config.toml, passed explicitly so they hold from any directory
STREAMLIT_SETTINGS = {
    "server.headless": "true",  # no browser launch and no first-run e-mail prompt on stdin
    "browser.gatherUsageStats": "false",
    "client.toolbarMode": "minimal",  # hides the Deploy button and the developer menu
}


def engine_command(capture: Path, workload: str, num_requests: int, pace: float) -> list[str]:
    return [sys.executable, "-m", "kvscope", "run", "--workload", workload, "--pace", str(pace),
            "--num-requests", str(num_requests), "--capture", str(capture)]


def dashboard_command(capture: Path, port: int | None = None, host: str = DEFAULT_HOST) -> list[str]:
    server = [] if port is None else ["--server.port", str(port)]
    settings = [arg for key, value in STREAMLIT_SETTINGS.items() for arg in (f"--{key}", value)]
    return [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.address", host, *server,
            *settings, "--", "--db", str(capture)]


def live_capture_path(runs_dir: Path, now: float | None = None) -> Path:
    return runs_dir / time.strftime("%Y%m%d-%H%M%S-live.db", time.localtime(now))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def say(line: str) -> None:
    print(f"kvscope: {line}", flush=True)


def _wait_for(capture: Path, engine: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + WAIT_FOR_CAPTURE_S
    while time.monotonic() < deadline:
        if capture.exists() and capture.stat().st_size > 0:
            return True
        if engine.poll() is not None:
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workload", default="multi-turn", help="the generated workload to record")
    parser.add_argument("--num-requests", type=int, default=200, help="requests in the workload")
    parser.add_argument("--pace", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address the dashboard listens on (0.0.0.0: every one)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port the dashboard listens on")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs", help="folder of the new capture")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    capture = live_capture_path(args.runs_dir.resolve())
    capture.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting the engine (loading torch takes a few seconds); recording {_shown(capture)}")
    engine = subprocess.Popen(engine_command(capture, args.workload, args.num_requests, args.pace), cwd=ROOT)
    dashboard: subprocess.Popen[bytes] | None = None
    try:
        if not _wait_for(capture, engine):
            print(f"kvscope: error: kvscope run did not start a capture at {capture}", file=sys.stderr)
            return 1
        say(f"starting the dashboard on http://{args.host}:{args.port} (Ctrl-C stops both)")
        dashboard = subprocess.Popen(dashboard_command(capture, args.port, args.host), cwd=ROOT)
        return dashboard.wait()
    except KeyboardInterrupt:
        say("stopping the engine and the dashboard")
        return 0  # a Ctrl-C is how this is meant to end: no error line from make
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        for process in (dashboard, engine):
            if process is not None:
                _stop(process)
        say(f"stopped; the capture is {_shown(capture)}")


if __name__ == "__main__":
    sys.exit(main())
