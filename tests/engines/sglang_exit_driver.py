"""SGLang 0.5.23's real PagedTokenToKVPoolAllocator under the probe in a process that exits without
a census or a step: its allocator calls are still queued for the ledger's fold when it ends (the
probe folds every FOLD_INTERVAL_S or FOLD_CALLS entries at a step, at a census, and at exit). Run
under `kvscope instrument` with the SGLang venv's python, the repository on PYTHONPATH:

    python sglang_exit_driver.py plain|spawn

plain: this process does the work and exits normally (atexit); spawn: a child started with
multiprocessing's spawn method does it, as SGLang starts its scheduler (multiprocessing's finalizers,
no atexit). SGLang's own load_plugins() installs the probe in the process that works. Prints one
JSON line: the pages each alloc took and each free released, in call order.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engines.sglang_standins import install

install()

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

PS = 4  # tokens per page


def work(out: Any) -> None:
    """Three allocs and a free on SGLang's allocator, then return (no step, no idle point)."""
    load_plugins()
    allocator = PagedTokenToKVPoolAllocator(32 * PS, PS, torch.int64, "cpu", None, False)
    taken = [allocator.alloc(2 * PS) for _ in range(3)]
    allocator.free(taken[1])
    calls = [("alloc", sorted({int(s) // PS for s in t.tolist()})) for t in taken]
    calls.append(("free", sorted({int(s) // PS for s in taken[1].tolist()})))
    out.put(calls)


def main(mode: str) -> None:
    if mode == "spawn":
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=work, args=(queue,))
        child.start()
        calls = queue.get(timeout=300)
        child.join(timeout=300)
        assert child.exitcode == 0, child.exitcode
    else:
        queue = multiprocessing.SimpleQueue()
        work(queue)
        calls = queue.get()
    print(json.dumps({"calls": calls}))


if __name__ == "__main__":
    main(sys.argv[1])
