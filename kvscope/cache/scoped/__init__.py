"""The tenant-scoped radix cache (docs/isolation.md): private and public nodes, epoch windows,
promotion by distinct creators, demotion by tombstone, and "logical free" at page granularity.

    node.py      ScopedNode (visibility, holders, hit window, path hash) and the copy lists
    window.py    two-bucket epoch windows with touch-time rollover
    creators.py  the KV-less shadow content trie: who computed which prefix, in the window
    monitor.py   the anomaly monitor's knobs and trip rule (off by default)
    cache.py     ScopedRadixCache
"""

from kvscope.cache.scoped.cache import ScopedRadixCache, ScopedStats
from kvscope.cache.scoped.monitor import MonitorConfig
from kvscope.cache.scoped.node import PINNED, PRIVATE, PUBLIC, VISIBILITIES, ScopedNode

__all__ = [
    "PINNED",
    "PRIVATE",
    "PUBLIC",
    "VISIBILITIES",
    "MonitorConfig",
    "ScopedNode",
    "ScopedRadixCache",
    "ScopedStats",
]
