"""Workloads and traces: seeded generators and the JSONL trace format.

A bottom layer: imports only numpy and the standard library, nothing else from kvscope.
"""

from kvscope.workloads.generators import WORKLOADS, generate
from kvscope.workloads.request import TraceRequest
from kvscope.workloads.tokenizer import ByteTokenizer
from kvscope.workloads.trace import TraceError, read_trace, write_trace

__all__ = [
    "WORKLOADS",
    "ByteTokenizer",
    "TraceError",
    "TraceRequest",
    "generate",
    "read_trace",
    "write_trace",
]
