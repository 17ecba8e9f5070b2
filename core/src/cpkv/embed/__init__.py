"""cpkv.embed: cpkv inside an engine's forward (docs/embedding.md).

The engine keeps its scheduler, its slot allocator, its KV tensors and its kernels; cpkv gives
the plan, page ownership, the full view, the transfer manifest and the prefix-cache rules::

    from cpkv.embed import EngineKV, KVBufferSpec, backend_ops

    spec = KVBufferSpec.wrap(fmt, "two_part", [(latent[i], index_k[i]) for i in range(layers)])
    kv = EngineKV(spec, group, backend_ops(group))          # the tensors are never copied
    plan = kv.plan([("req", n_tokens)])                      # host ints only, same on every rank
    batch = kv.prepare(plan, ["req"], given={"req": my_pages})  # (owner, slot) per new page
    for layer in range(layers):                              # inside torch.compile / graphs
        kv.put_bytes(layer, batch, latent_bytes, index_bytes)   # already packed by the engine
        view = kv.view(layer, batch)                         # one all-gather of owned pages
        ...                                                  # the engine's indexer / sparse MLA
    kv.commit(batch)

Per-layer calls are ``torch.library`` custom ops (``cpkv::put_bytes``, ``cpkv::take_bytes``,
``cpkv::all_gather_pages``, ``cpkv::owner_put_bytes``; :mod:`cpkv.embed.library`), so a forward
calling them compiles with ``torch.compile(fullgraph=True)``; :class:`DecodeMetadata` is the
fixed-capacity metadata a CUDA-graph decode step replays with; :mod:`cpkv.embed.rules` holds the
key ranges and the prefix-cache rules as pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from cpkv.comm import CPGroup, GpuPlacement, rank_gpu, shared_gpus_line
from cpkv.kv import FullView, pack_rows, ragged_to_paged, unpack_rows
from cpkv.kv.buffers import (
    BufferLayout,
    KVBufferSpec,
    LayerBuffers,
    read_pages,
    read_rows,
    write_pages,
    write_rows,
)
from cpkv.ops import OpTable

from . import library
from .decode import DecodeMetadata
from .engine import EngineBatch, EngineKV
from .rules import KeyRanges, TailCopy, hit_pages, key_ranges, tail_copy, token_valid_hit

__all__ = ["BufferLayout", "DecodeMetadata", "EngineBatch", "EngineKV", "FullView", "GpuPlacement",
           "KVBufferSpec", "KeyRanges", "LayerBuffers", "TailCopy", "backend_ops", "hit_pages",
           "key_ranges", "library", "pack_rows", "ragged_to_paged", "rank_gpu", "read_pages",
           "read_rows", "shared_gpus_line", "tail_copy", "token_valid_hit", "unpack_rows",
           "write_pages", "write_rows"]


def backend_ops(group: CPGroup, preference: Sequence[str] = ("torch",)) -> OpTable:
    """The op table of the first backends in ``preference`` every rank of ``group`` can run
    (agreed across ranks, a collective): what an engine's attention calls go through when it
    uses cpkv's kernels (the indexer, top-k, sparse MLA) rather than its own."""
    from cpkv.ops import ALL_OPS
    from cpkv.runtime.setup import resolve_ops
    from cpkv.settings import load_settings

    settings = load_settings(cp={"size": group.size}, backend={"preference": list(preference)})
    return resolve_ops(settings, group, ops=ALL_OPS)[0]
