"""GPU memory and utilization through pynvml (nvidia-ml-py); torch-free. Empty without a GPU."""

from __future__ import annotations

import pandas as pd

COLUMNS = ["index", "name", "memory_used_mib", "memory_total_mib", "utilization_pct"]
MIB_PER_GIB = 1024


def total_gib(gpus: pd.DataFrame) -> float | None:
    """The first GPU's memory in GiB, from probe()'s rows; None when there is no GPU."""
    if gpus.empty:
        return None
    return float(gpus["memory_total_mib"].iloc[0]) / MIB_PER_GIB


def probe() -> pd.DataFrame:
    try:
        import pynvml
    except ImportError:
        return pd.DataFrame(columns=COLUMNS)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return pd.DataFrame(columns=COLUMNS)
    try:
        rows = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            rows.append(
                [
                    index,
                    name.decode() if isinstance(name, bytes) else str(name),
                    int(memory.used) >> 20,
                    int(memory.total) >> 20,
                    int(util.gpu),
                ]
            )
        return pd.DataFrame(rows, columns=COLUMNS)
    except pynvml.NVMLError:
        return pd.DataFrame(columns=COLUMNS)
    finally:
        pynvml.nvmlShutdown()
