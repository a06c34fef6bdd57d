"""Shared test setup: the `cuda` marker skips (with its reason shown by -ra) without a GPU; the `engines`
marker (a real SGLang or vLLM server) skips unless `-m engines` selects it."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
torch.set_num_threads(1)  # tiny tensors: a second intra-op thread only adds stalls on 2-core machines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {}
    if not CUDA:
        skips["cuda"] = pytest.mark.skip(reason="needs a CUDA device; none present on this machine")
    if not engines_selected(config):
        skips["engines"] = pytest.mark.skip(reason="starts a real engine server: run with `pytest -m engines`")
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
