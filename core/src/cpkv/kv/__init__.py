"""The sharded KV pool: a host-side page table, a device store, and the pool facade over them."""

from .allocator import PageAllocator, PoolExhausted
from .batch import BatchKV, MaterializePlan, to_device_at_once
from .indices import ragged_to_paged
from .materialize import (
    AllGatherViews,
    Materializer,
    PeerViews,
    Prefetch,
    ReplicaViews,
    open_materializer,
)
from .pages import RequestPages, Reservation
from .pool import ShardedKVPool
from .rows import RowLayout
from .stage import PageLoad
from .store import KVStore
from .table import PageTable
from .view import AttentionKeys, FullView, pack_rows, unpack_rows

__all__ = [
    "AllGatherViews",
    "AttentionKeys",
    "BatchKV",
    "FullView",
    "KVStore",
    "MaterializePlan",
    "Materializer",
    "PageAllocator",
    "PageLoad",
    "PageTable",
    "PeerViews",
    "PoolExhausted",
    "Prefetch",
    "ReplicaViews",
    "RequestPages",
    "Reservation",
    "RowLayout",
    "ShardedKVPool",
    "open_materializer",
    "pack_rows",
    "ragged_to_paged",
    "to_device_at_once",
    "unpack_rows",
]
