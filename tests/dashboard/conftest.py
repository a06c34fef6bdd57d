from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# NOTE: the sample captures, and a capture of schema version 1 written by kvscope before insert
# events carried their owner (tests/telemetry/data/schema_v1.db): every page must open both
SAMPLES = [*sorted((ROOT / "sample_runs").glob("*.db")), ROOT / "tests" / "telemetry" / "data" / "schema_v1.db"]
PAGES = ("overview", "memory", "tiers", "tree", "evictions", "leaks", "requests", "capacity", "fleet")


@pytest.fixture(params=SAMPLES, ids=[p.stem for p in SAMPLES])
def sample(request: pytest.FixtureRequest) -> Path:
    return Path(request.param)
