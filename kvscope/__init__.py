"""kvscope: observability dashboard and memory debugger for SGLang-style KV-cache memory."""

__version__ = "0.1.0"
