"""The sharded KV pool: page ownership, direct and owner writes, full-view materialization."""

from .allocator import PageAllocator, PoolExhausted
from .batch import BatchKV, MaterializePlan, RequestPages
from .indices import ragged_to_paged
from .pool import ShardedKVPool
from .rows import RowLayout
from .view import FullView, pack_rows, unpack_rows

__all__ = [
    "BatchKV",
    "FullView",
    "MaterializePlan",
    "PageAllocator",
    "PoolExhausted",
    "RequestPages",
    "RowLayout",
    "ShardedKVPool",
    "pack_rows",
    "ragged_to_paged",
    "unpack_rows",
]
