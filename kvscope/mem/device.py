"""Device selection: `cuda` when a GPU is present, else `cpu`."""

from __future__ import annotations

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """The torch device to place pools on.

    None or "auto" picks `cuda` when available, else `cpu`. An explicit "cuda" without a
    GPU raises ValueError with one clear line rather than failing later inside torch.
    """
    if isinstance(name, torch.device):
        return name
    if name is None or name == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not cuda_available():
        raise ValueError(f"device {name!r} requested but no CUDA device is available")
    return device
