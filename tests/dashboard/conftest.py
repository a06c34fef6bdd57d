from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "sample_runs").glob("*.db"))
PAGES = ("overview", "memory", "tree", "evictions", "leaks", "requests", "capacity")


@pytest.fixture(params=SAMPLES, ids=[p.stem for p in SAMPLES])
def sample(request: pytest.FixtureRequest) -> Path:
    return Path(request.param)
