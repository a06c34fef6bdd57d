"""Import-only stand-ins for the GPU-only modules SGLang 0.5.23's memory, plugin and scheduler
modules import at the top (tests only; never shipped, never installed in the SGLang venv).

`install()` puts a finder at the head of sys.meta_path that answers for the top-level names in
STANDINS (and every submodule under them) with a module whose every attribute is an Anything
(_anything.py): a decorator that returns what it decorates, a base class, a callable. On the CPU
none of them runs: the paged allocator takes its torch path (alloc_extend_naive) because the
platform reports no Triton support, and the trees and pools are plain torch and Python.

NOTE: why each is here (what imports it; none has a CPU wheel that imports without a GPU stack)
    triton, triton.language        allocator kernels, memory_pool, layers (decorators and tl types only)
    tvm_ffi                         sgl-kernel's JIT bindings, imported by srt.utils
    torchvision                     multimodal utilities reached from schedule_batch
    compressed_tensors              quantization configs reached from model_config
    aiohttp, IPython                utilities reached from srt.utils (aiohttp is real for SGLang's
                                    bench_serving client: install(real=("aiohttp",)))
    sgl_kernel                      the CUDA kernels package (its import is guarded in most places)
    datasets                        Hugging Face datasets, imported by bench_serving's MMMU loader (unused)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

from tests.engines.sglang_standins._anything import standin

STANDINS = (
    "triton",
    "tvm_ffi",
    "torchvision",
    "compressed_tensors",
    "aiohttp",
    "IPython",
    "sgl_kernel",
    "xgrammar",
    "datasets",
)


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, real: tuple[str, ...] = ()) -> None:
        self.names = tuple(name for name in STANDINS if name not in real)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> ModuleType:
        return standin(spec.name, __version__="0.0.0")

    def exec_module(self, module: ModuleType) -> None:
        pass


def install(real: tuple[str, ...] = ()) -> None:
    """`real`: names of STANDINS to import as installed instead (the first install decides)."""
    if not any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandinFinder(real))
        _configs_registered_as_on_their_transformers()


def _configs_registered_as_on_their_transformers() -> None:
    """SGLang 0.5.18 and 0.5.19 pin transformers 5.12.1 and register configs (qwen3_asr) that the shared
    venv's transformers 5.19.0 already has, which raises there: such a registration replaces the
    built-in one, as it took the unused name on 5.12.1. Names transformers lacks register as before."""
    from transformers import AutoConfig

    register = AutoConfig.register

    def register_over_builtin(model_type: str, config: Any, exist_ok: bool = False) -> None:
        register(model_type, config, exist_ok=True)

    AutoConfig.register = staticmethod(register_over_builtin)  # type: ignore[method-assign]
