"""Shared test setup: the `cuda` marker skips (with its reason shown by -ra) without a GPU."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
torch.set_num_threads(1)  # tiny tensors: a second intra-op thread only adds stalls on 2-core machines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none present on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def device_params() -> list[object]:
    """Parametrize a test over cpu and (marked) cuda."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
