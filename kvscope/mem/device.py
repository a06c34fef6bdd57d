"""Device selection (`cuda` when a GPU is present, else `cpu`) and the memory a device has free."""

from __future__ import annotations

import os
import re

import torch

DEVICE_FORMS = "auto, cpu, cuda or cuda:N"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """The torch device to place pools on.

    None or "auto" picks `cuda` when available, else `cpu`. Anything but auto, cpu, cuda and
    cuda:N, or a GPU that is not there, raises ValueError with one clear line rather than
    failing later inside torch.
    """
    if isinstance(name, torch.device):
        return name
    if name is None or name == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", name.strip())
    if not match:
        raise ValueError(f"unknown device {name!r}; use {DEVICE_FORMS}")
    if match[1] == "cuda" and not cuda_available():
        raise ValueError(f"device {name!r} requested but no CUDA device is available")
    if match[1] == "cuda" and match[2] is not None and int(match[2]) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device(name.strip())


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can still get: free GPU memory (cudaMemGetInfo), or the RAM the
    OS reports available (Linux MemAvailable, else free pages); None when unknown."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    if device.type != "cpu":
        return None
    return _meminfo_available_bytes() or _sysconf_available_bytes()


def _meminfo_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # NOTE: the kernel writes kB meaning KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sysconf_available_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
