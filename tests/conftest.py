"""Shared test setup: the `cuda` marker skips (with its reason shown by -ra) without a GPU; the `engines`
marker (a real SGLang or vLLM server) skips unless `-m engines` selects it; the `postgres` marker (a real
PostgreSQL server) skips unless KVSCOPE_TEST_POSTGRES_URL names one (`make test-postgres` starts a throwaway
cluster and sets it: tests/postgres_cluster.py)."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

# NOTE: the readers' cache of page checks (kvscope/telemetry/page_checks.py) goes to a folder of this run,
# inherited by the subprocesses tests start: a test never reads or writes the user's own cache
os.environ.setdefault("KVSCOPE_CACHE_DIR", tempfile.mkdtemp(prefix="kvscope-test-cache-"))
# NOTE: the dashboard lowers its process's priority (kvscope/dashboard/priority.py): AppTest runs it in the
# test process, which must keep its own (the engines the later tests start inherit it)
os.environ.setdefault("KVSCOPE_DASHBOARD_NICE", "0")
CUDA = torch.cuda.is_available()
POSTGRES_URL_VAR = "KVSCOPE_TEST_POSTGRES_URL"
torch.set_num_threads(1)  # tiny tensors: a second intra-op thread only adds stalls on 2-core machines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {}
    if not CUDA:
        skips["cuda"] = pytest.mark.skip(reason="needs a CUDA device; none present on this machine")
    if not engines_selected(config):
        skips["engines"] = pytest.mark.skip(reason="starts a real engine server: run with `pytest -m engines`")
    if not os.environ.get(POSTGRES_URL_VAR):
        skips["postgres"] = pytest.mark.skip(
            reason=f"needs a PostgreSQL server: {POSTGRES_URL_VAR} is not set (`make test-postgres` starts one)"
        )
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


def engines_selected(config: pytest.Config) -> bool:
    """`engines` tests (minutes each) run only when `-m` asks for them by name."""
    expression = str(config.getoption("markexpr") or "")
    return "engines" in expression and "not engines" not in expression


def device_params() -> list[object]:
    """Parametrize a test over cpu and (marked) cuda."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@contextmanager
def postgres_database() -> Iterator[str]:
    """A new, empty database on the test server (its URL), dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    server = make_url(os.environ[POSTGRES_URL_VAR])
    name = f"t_{secrets.token_hex(6)}"
    admin = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A new, empty database on the test server (`postgres`-marked tests)."""
    with postgres_database() as url:
        yield url
