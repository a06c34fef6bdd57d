"""A throwaway PostgreSQL cluster for the `postgres`-marked tests (`make test-postgres`).

    python -m tests.postgres_cluster [--no-install] -- COMMAND...

installs PostgreSQL from Debian's packages when no server binaries are found (root only), makes a cluster
in a temporary directory (initdb under the `postgres` user when run as root: the server refuses to run as
root), starts it on 127.0.0.1 at a free port with a password-authenticated role and database, runs COMMAND
with the cluster's URL in KVSCOPE_TEST_POSTGRES_URL, then stops the server and removes the directory (also
when COMMAND fails or is interrupted). Its exit status is COMMAND's.

NOTE: what COMMAND finds in its environment
    KVSCOPE_TEST_POSTGRES_URL    postgresql://kvscope:PASSWORD@127.0.0.1:PORT/kvscope (a superuser)
    KVSCOPE_TEST_POSTGRES_DATA   the cluster's data directory (tests stop and start the server there)
    KVSCOPE_TEST_POSTGRES_BIN    the directory of pg_ctl
    KVSCOPE_TEST_POSTGRES_USER   the user the server runs as ("" when it is the current user)
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

ROLE = "kvscope"
START_TIMEOUT_S = 60


def find_bin_dir() -> Path | None:
    """The directory holding initdb and pg_ctl: Debian's newest /usr/lib/postgresql/N/bin, else PATH."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name or 0))
    for directory in reversed(candidates):
        if Path(directory, "pg_ctl").exists() and Path(directory, "initdb").exists():
            return Path(directory)
    found = shutil.which("pg_ctl")
    if found and Path(found).with_name("initdb").exists():
        return Path(found).parent
    return None


def install_server() -> Path:
    """Debian's postgresql package (needs root); the directory of its binaries."""
    if os.geteuid() != 0:
        raise SystemExit("postgres_cluster: no PostgreSQL found and not root: install Debian's `postgresql` package")
    print("postgres_cluster: installing PostgreSQL from Debian's packages", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "postgresql"], check=True, env=env, stdout=subprocess.DEVNULL)
    found = find_bin_dir()
    if found is None:
        raise SystemExit("postgres_cluster: the postgresql package installed no pg_ctl")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    """A cluster in `root` (data in root/data, the socket in root), served by `user` ('' = us)."""

    bin_dir: Path
    root: Path
    user: str
    port: int
    password: str

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql://{ROLE}:{self.password}@127.0.0.1:{self.port}/{ROLE}"

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Cluster:
        """The cluster a test runs against (from the variables `run` sets)."""
        from sqlalchemy.engine import make_url

        url = make_url(env["KVSCOPE_TEST_POSTGRES_URL"])
        data_dir = Path(env["KVSCOPE_TEST_POSTGRES_DATA"])
        bin_dir = Path(env["KVSCOPE_TEST_POSTGRES_BIN"])
        return cls(bin_dir, data_dir.parent, env["KVSCOPE_TEST_POSTGRES_USER"], int(url.port or 0), str(url.password))

    def env(self) -> dict[str, str]:
        return {
            "KVSCOPE_TEST_POSTGRES_URL": self.url,
            "KVSCOPE_TEST_POSTGRES_DATA": str(self.data_dir),
            "KVSCOPE_TEST_POSTGRES_BIN": str(self.bin_dir),
            "KVSCOPE_TEST_POSTGRES_USER": self.user,
        }


def as_server_user(user: str, argv: list[str]) -> list[str]:
    return ["runuser", "-u", user, "--", *argv] if user else argv


def pg_ctl(bin_dir: Path, data_dir: Path, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = as_server_user(user, [str(bin_dir / "pg_ctl"), "-D", str(data_dir), *args])
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def start(cluster: Cluster) -> None:
    """Start the server and wait for it (the log is in root/server.log)."""
    options = f"-c listen_addresses=127.0.0.1 -p {cluster.port} -k {cluster.root} -c fsync=off"
    done = pg_ctl(
        cluster.bin_dir,
        cluster.data_dir,
        cluster.user,
        "start",
        "-w",
        "-t",
        str(START_TIMEOUT_S),
        "-l",
        str(cluster.root / "server.log"),
        "-o",
        options,
    )
    if done.returncode != 0:
        log = (
            (cluster.root / "server.log").read_text(errors="replace") if (cluster.root / "server.log").exists() else ""
        )
        raise SystemExit(f"postgres_cluster: the server did not start: {done.stderr.strip()} {log[-2000:]}")


def stop(cluster: Cluster, mode: str = "fast") -> None:
    pg_ctl(cluster.bin_dir, cluster.data_dir, cluster.user, "stop", "-w", "-m", mode)


def create(bin_dir: Path) -> Cluster:
    """initdb a cluster in a new temporary directory (owned by the server's user)."""
    user = "postgres" if os.geteuid() == 0 else ""
    root = Path(tempfile.mkdtemp(prefix="kvscope-pg-"))
    password = secrets.token_hex(12)
    cluster = Cluster(bin_dir, root, user, free_port(), password)
    (root / "pwfile").write_text(password + "\n")
    if user:
        shutil.chown(root, user)
        shutil.chown(root / "pwfile", user)
    argv = [
        str(bin_dir / "initdb"),
        "-D",
        str(cluster.data_dir),
        "-U",
        ROLE,
        "--pwfile",
        str(root / "pwfile"),
        "-A",
        "scram-sha-256",
        "-E",
        "UTF8",
        "--locale=C",
        "--no-sync",
    ]
    done = subprocess.run(as_server_user(user, argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"postgres_cluster: initdb failed: {done.stderr.strip() or done.stdout.strip()}")
    return cluster


def create_database(cluster: Cluster) -> None:
    """The role's own database (initdb makes only `postgres`), made through the server's client."""
    argv = as_server_user(
        cluster.user,
        [str(cluster.bin_dir / "createdb"), "-h", str(cluster.root), "-p", str(cluster.port), "-U", ROLE, ROLE],
    )
    env = {**os.environ, "PGPASSWORD": cluster.password}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"postgres_cluster: createdb failed: {done.stderr.strip()}")


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(command: list[str], install: bool) -> int:
    bin_dir = find_bin_dir()
    if bin_dir is None:
        if not install:
            raise SystemExit("postgres_cluster: no PostgreSQL server binaries found (initdb, pg_ctl)")
        bin_dir = install_server()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    cluster = create(bin_dir)
    try:
        start(cluster)
        create_database(cluster)
        print(f"postgres_cluster: PostgreSQL ({bin_dir}) on 127.0.0.1:{cluster.port}, data in {cluster.data_dir}")
        return subprocess.run(command, env={**os.environ, **cluster.env()}, check=False).returncode
    finally:
        stop(cluster, "immediate")
        shutil.rmtree(cluster.root, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.postgres_cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing PostgreSQL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND... (run with the cluster's URL)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given")
    return run(command, install=not args.no_install)


def restart_main(argv: list[str]) -> int:
    """`python -m tests.postgres_cluster stop-immediate|start` on the cluster of the environment."""
    cluster = Cluster.from_env(dict(os.environ))
    if argv[0] == "start":
        start(cluster)
    else:
        stop(cluster, "immediate")
    return 0


if __name__ == "__main__":
    sys.exit(restart_main(sys.argv[1:]) if sys.argv[1:2] in (["start"], ["stop-immediate"]) else main(sys.argv[1:]))
