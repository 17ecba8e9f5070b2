"""Prefix cache over the sharded pool: token-valid hits over page-aligned extents (rules 28-29)."""

from .prefix import CacheStats, PrefixCache
from .radix import PageRef, PrefixMatch, RadixTree

__all__ = ["CacheStats", "PageRef", "PrefixCache", "PrefixMatch", "RadixTree"]
