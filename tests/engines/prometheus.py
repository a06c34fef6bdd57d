"""A throwaway Prometheus for the `engines` tests: Debian's `prometheus` binary (installed with apt-get
when missing, as root; else the test fails saying so) on 127.0.0.1 at a free port, with a config and a
TSDB in a temp dir, scraping `targets` (host:port, path /metrics) every `scrape_interval_s` and
evaluating `rule_files` at the same interval.

    with prometheus_server(["127.0.0.1:8000"], [RULES], scrape_interval_s=1.0) as prom:
        prom.wait_for_scrape()
        prom.query("kvscope_probe_up")     # the result vector: [{"metric": {...}, "value": [t, "1"]}, ...]
        prom.alerts()                      # active alerts: [{"labels": {...}, "state": "firing", ...}, ...]
Stopped with SIGTERM (SIGKILL after 10 s) and its dir removed when the block ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.engines.vllm_server import free_port

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def prometheus_binary() -> str:
    """Debian's prometheus on PATH, installed first when missing (root only)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        raise RuntimeError("no prometheus binary and not root: install Debian's `prometheus` package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], check=True, env=env, stdout=subprocess.DEVNULL)
    found = shutil.which("prometheus")
    if found is None:
        raise RuntimeError("the prometheus package installed no prometheus binary")
    return found


@dataclass(frozen=True)
class Prometheus:
    url: str
    log: Path

    def api(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10.0)
        body = response.json()
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('error', response.text)}")
        return body["data"]

    def query(self, expr: str) -> list[Any]:
        """An instant query's result (a vector's samples; a scalar as one [t, value] pair)."""
        data = self.api("query", query=expr)
        return list(data["result"]) if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def alerts(self) -> list[Any]:
        """Active alerts (pending or firing)."""
        return list(self.api("alerts")["alerts"])

    def rule_groups(self) -> list[Any]:
        """The rule files as Prometheus loaded them (each rule with its health and last error)."""
        return list(self.api("rules")["groups"])

    def wait_for_scrape(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every target was scraped successfully once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            targets = self.api("targets")["activeTargets"]
            if targets and all(t["health"] == "up" for t in targets):
                return
            time.sleep(0.5)
        raise TimeoutError(f"prometheus: targets not up after {timeout_s:.0f} s: {json.dumps(targets)[:500]}")

    def wait_for(self, expr: str, timeout_s: float) -> list[Any]:
        """Until `expr` returns samples; its result."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.5)
        raise TimeoutError(f"prometheus: no data for {expr} after {timeout_s:.0f} s")


def config_text(targets: list[str], rule_files: list[Path], scrape_interval_s: float) -> str:
    """prometheus.yml as JSON (a YAML subset)."""
    interval = f"{int(scrape_interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": [{"job_name": "engines", "static_configs": [{"targets": targets}]}],
    }
    return json.dumps(config, indent=1)


@contextmanager
def prometheus_server(targets: list[str], rule_files: list[Path], scrape_interval_s: float) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    with tempfile.TemporaryDirectory(prefix="kvscope-prom-") as tmp:
        config, log = Path(tmp, "prometheus.yml"), Path(tmp, "prometheus.log")
        config.write_text(config_text(targets, rule_files, scrape_interval_s))
        address = f"127.0.0.1:{free_port()}"
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp}/data",
            f"--web.listen-address={address}",
            "--web.enable-lifecycle",
        ]
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        prom = Prometheus(f"http://{address}", log)
        try:
            _wait_ready(prom, process)
            yield prom
        finally:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(prom: Prometheus, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited {process.returncode}: {prom.log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{prom.url}/-/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"prometheus not ready after {READY_TIMEOUT_S:.0f} s: {prom.log.read_text()[-2000:]}")
