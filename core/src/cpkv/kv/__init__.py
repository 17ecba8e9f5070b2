"""The sharded KV pool: page ownership, direct and owner writes, full-view materialization."""

from .allocator import PageAllocator, PoolExhausted
from .batch import BatchKV, MaterializePlan, RequestPages, to_device_at_once
from .indices import ragged_to_paged
from .materialize import (
    AllGatherViews,
    Materializer,
    PeerViews,
    Prefetch,
    ReplicaViews,
    open_materializer,
)
from .pool import ShardedKVPool
from .rows import RowLayout
from .view import FullView, pack_rows, unpack_rows

__all__ = [
    "AllGatherViews",
    "BatchKV",
    "FullView",
    "MaterializePlan",
    "Materializer",
    "PageAllocator",
    "PeerViews",
    "PoolExhausted",
    "Prefetch",
    "ReplicaViews",
    "RequestPages",
    "RowLayout",
    "ShardedKVPool",
    "open_materializer",
    "pack_rows",
    "ragged_to_paged",
    "to_device_at_once",
    "unpack_rows",
]
