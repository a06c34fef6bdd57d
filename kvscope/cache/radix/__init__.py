"""The radix prefix cache over one full-attention pool (SGLang's RadixCache)."""

from kvscope.cache.radix.cache import RadixCache

__all__ = ["RadixCache"]
