"""The environment part of a run's config fingerprint: host, versions, device, GPUs (pynvml)."""

from __future__ import annotations

import platform
import socket
from importlib import metadata
from typing import Any

PACKAGES = ("kvscope", "torch", "numpy", "sqlalchemy", "streamlit", "plotly", "nvidia-ml-py")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_inventory() -> list[dict[str, Any]]:
    """Name and total memory of every visible GPU through pynvml; [] without a GPU or driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "total_memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                }
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def environment_fingerprint(device: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "device": device,
        "gpus": gpu_inventory(),
    }
