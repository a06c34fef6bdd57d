"""GPU memory from NVML (pynvml, from nvidia-ml-py): every visible GPU, no torch, no CUDA context.

Visible means listed by CUDA_VISIBLE_DEVICES (indices or UUIDs) when it is set, else every
GPU NVML reports. No driver or no GPU: an empty list.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple


class GpuInfo(NamedTuple):
    gpu_index: int  # NVML index
    name: str
    total_bytes: int
    free_bytes: int
    uuid: str = ""


def probe_gpus() -> list[GpuInfo]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NOTE: no pynvml, no driver, no device: all mean "no GPU here"
        return []
    try:
        gpus = [_info(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    return visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _info(pynvml: Any, index: int) -> GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    name, uuid = _text(pynvml.nvmlDeviceGetName(handle)), _text(pynvml.nvmlDeviceGetUUID(handle))
    return GpuInfo(index, name, int(memory.total), int(memory.free), uuid)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible(gpus: list[GpuInfo], cuda_visible_devices: str | None) -> list[GpuInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES names, in its order (all of them when it is unset)."""
    if cuda_visible_devices is None:
        return gpus
    chosen = []
    for item in (s.strip() for s in cuda_visible_devices.split(",")):
        match = [g for g in gpus if (item.isdigit() and g.gpu_index == int(item)) or (item and g.uuid.startswith(item))]
        if not match:
            break  # NOTE: CUDA stops at the first invalid entry
        chosen.append(match[0])
    return chosen
