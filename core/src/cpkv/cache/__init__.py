"""Prefix cache over the sharded pool: token-valid hits over page-aligned extents (rules 28-29)."""

from .prefix import CacheStats, HostLoads, PrefixCache
from .radix import PageRef, PrefixMatch, RadixTree
from .v4_prefix import V4Hit, V4PrefixCache, V4Snapshot

__all__ = ["CacheStats", "HostLoads", "PageRef", "PrefixCache", "PrefixMatch", "RadixTree",
           "V4Hit", "V4PrefixCache", "V4Snapshot"]
