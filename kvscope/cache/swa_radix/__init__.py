"""The radix prefix cache of hybrid sliding-window models: tombstones, window locks,
two-phase eviction (SGLang's SWARadixCache)."""

from kvscope.cache.swa_radix.cache import SWARadixCache

__all__ = ["SWARadixCache"]
