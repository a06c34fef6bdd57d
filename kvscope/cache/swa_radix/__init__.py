"""The radix prefix cache of hybrid sliding-window models: tombstones, window locks,
two-phase eviction (SGLang's SWARadixCache)."""

from kvscope.cache.swa_radix.cache import SWARadixCache
from kvscope.cache.swa_radix.node import SWANode

__all__ = ["SWANode", "SWARadixCache"]
