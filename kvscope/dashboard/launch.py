"""`make run`: record a paced workload in the background and open the dashboard on it, live.

    python -m kvscope.dashboard.launch [--num-requests N] [--pace RATE] [--workload NAME]

Starts `kvscope run … --capture runs/<time>-live.db`, waits for the capture to exist, then
runs `streamlit run app.py -- --db <capture>`. Ctrl-C (or either process ending badly)
stops both. Torch-free: the engine runs in its own process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAIT_FOR_CAPTURE_S = 60.0


def engine_command(capture: Path, workload: str, num_requests: int, pace: float) -> list[str]:
    return [sys.executable, "-m", "kvscope", "run", "--workload", workload, "--pace", str(pace),
            "--num-requests", str(num_requests), "--capture", str(capture)]


def dashboard_command(capture: Path, port: int | None = None) -> list[str]:
    server = [] if port is None else ["--server.port", str(port)]
    return [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), *server, "--", "--db", str(capture)]


def live_capture_path(runs_dir: Path, now: float | None = None) -> Path:
    return runs_dir / time.strftime("%Y%m%d-%H%M%S-live.db", time.localtime(now))


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
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="multi-turn")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--pace", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    capture = live_capture_path(ROOT / "runs")
    capture.parent.mkdir(parents=True, exist_ok=True)
    engine = subprocess.Popen(engine_command(capture, args.workload, args.num_requests, args.pace), cwd=ROOT)
    dashboard: subprocess.Popen[bytes] | None = None
    try:
        if not _wait_for(capture, engine):
            print(f"kvscope run did not start a capture at {capture}", file=sys.stderr)
            return 1
        print(f"recording {capture}; opening the dashboard (Ctrl-C stops both)", flush=True)
        dashboard = subprocess.Popen(dashboard_command(capture, args.port), cwd=ROOT)
        return dashboard.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        for process in (dashboard, engine):
            if process is not None:
                _stop(process)


if __name__ == "__main__":
    sys.exit(main())
