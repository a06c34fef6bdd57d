"""The two-tier radix cache: a device tier over a host tier (SGLang's HiRadixCache)."""

from kvscope.cache.hiradix.cache import LOAD_BACK_MIN_TOKENS, HiMatchResult, HiRadixCache, WritePolicy
from kvscope.cache.hiradix.node import HiTreeNode, Tier

__all__ = ["LOAD_BACK_MIN_TOKENS", "HiMatchResult", "HiRadixCache", "HiTreeNode", "Tier", "WritePolicy"]
