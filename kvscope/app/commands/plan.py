"""`kvscope plan`: its options; the body is kvscope/app/plan.py."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from kvscope.app.units import byte_size, positive_count
from kvscope.planning import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MEM_FRACTION_STATIC, KV_DTYPES, PRESETS


class PlanCommand:
    name = "plan"
    help = "KV bytes per token and how many tokens / requests fit, for a model on a GPU"
    description = (
        "KV-cache capacity of a model on a GPU: bytes per token, SGLang's max_total_num_tokens and pages, "
        "vLLM's GPU blocks, and how many requests of a context length fit at once. GPU memory comes from NVML "
        "for the visible GPUs (the smallest of the first --tp ones), or from --gpu-mem."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model",
            required=True,
            metavar="NAME|CONFIG",
            help=f"a preset ({', '.join(PRESETS)}), its Hugging Face id "
            "(meta-llama/Llama-3.1-8B-Instruct), "
            "or a Hugging Face config.json file",
        )
        parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
        parser.add_argument(
            "--kv-dtype",
            default="auto",
            choices=KV_DTYPES,
            metavar="DTYPE",
            help=f"KV cache dtype ({', '.join(KV_DTYPES)}); auto = the model's dtype",
        )
        parser.add_argument(
            "--gpu-mem",
            type=byte_size,
            metavar="SIZE",
            help="memory per GPU (SGLang: free at start; vLLM: total): 80 (GiB), 80G, 80GiB, 81920MiB, "
            "or 85.9GB for decimal bytes; default: NVML",
        )
        parser.add_argument(
            "--weights-gib",
            type=byte_size,
            metavar="SIZE",
            help="the whole model's weights (all TP ranks), a size like --gpu-mem's (16, 16GiB, "
            "16GB); default: the preset's",
        )
        parser.add_argument("--page-size", type=int, default=1, help="SGLang tokens per page")
        parser.add_argument(
            "--mem-fraction-static",
            type=float,
            default=DEFAULT_MEM_FRACTION_STATIC,
            help="SGLang: share of the memory free at start for weights + KV",
        )
        parser.add_argument(
            "--swa-full-tokens-ratio",
            type=float,
            default=0.8,
            help="SGLang hybrid SWA: SWA pool tokens per full pool token",
        )
        parser.add_argument(
            "--context-len",
            type=positive_count,
            default=8192,
            metavar="TOKENS",
            help="tokens per request (prompt + output): 8192, 8k, 128Ki",
        )
        parser.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=DEFAULT_GPU_MEMORY_UTILIZATION,
            help="vLLM: share of the GPU's total memory for the instance",
        )
        parser.add_argument("--block-size", type=int, default=16, help="vLLM tokens per block")
        parser.add_argument(
            "--vllm-activation-gib",
            type=byte_size,
            default=0,
            metavar="SIZE",
            help="vLLM: activation peak of its profile run, subtracted from its KV memory (2, 2GiB, 512MiB)",
        )
        parser.add_argument("--json", action="store_true", help="print the plan as JSON")

    def run(self, args: argparse.Namespace, out: TextIO | None = None) -> int:
        """out: where the body writes (a test's buffers); default the process's streams, read at
        call time (the body's own defaults were bound when it was first imported)."""
        from kvscope.app.plan import plan_verb

        return plan_verb(args, sys.stdout if out is None else out)
