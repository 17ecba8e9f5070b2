"""cpkv.embed: cpkv inside an engine's forward (docs/embedding.md is the guide).

The engine keeps its scheduler, its slot allocator, its KV tensors and its kernels; cpkv gives
the plan, page ownership, the full view, the transfer manifest and the prefix-cache rules::

    from cpkv.embed import EngineKV, KVBufferSpec

    spec = KVBufferSpec.wrap(fmt, "two_part", [(latent[i], index_k[i]) for i in range(layers)])
    kv = EngineKV(spec, group)                               # the tensors are never copied
    kv.adopt(rid, hit_pages(hit, owners, slots, ps), hit)    # a prefix hit, before the plan
    plan = kv.plan([(rid, n_new)])                           # host ints only, same on every rank
    given = {r: [alloc(o) for o in os] for r, os in kv.owners_to_give(plan, [rid]).items()}
    batch = kv.prepare(plan, [rid], given)                   # checked; copies on write made
    for layer in layers_kv:                                  # kv.layer(i), bound once
        kv.put_bytes(layer, batch, latent_bytes, index_bytes)   # quantize(...) for fp8
        view = kv.view(layer, batch)                         # one all-gather of owned pages
        ...                                                  # the engine's indexer / sparse MLA
    kv.commit(batch)
    alloc.give_back(kv.free(rid))                            # the slots nothing holds any more

Per-layer calls are ``torch.library`` custom ops (``cpkv::put_bytes``, ``cpkv::take_bytes``,
``cpkv::all_gather_pages``, ``cpkv::owner_put_bytes``; :mod:`cpkv.embed.library`), so a forward
calling them compiles with ``torch.compile(fullgraph=True)``; :class:`DecodeMetadata` is the
fixed-capacity metadata a CUDA-graph decode step replays with; :mod:`cpkv.embed.rules` holds the
key ranges, the logits rows and the prefix-cache rules as pure functions.
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
from .engine import EngineBatch, EngineKV, LayerKV, kv_ops
from .rules import (
    KeyRanges,
    LogitsRows,
    TailCopy,
    hit_pages,
    key_ranges,
    logits_rows,
    tail_copy,
    token_valid_hit,
)
from .write import quantize, rotate_index_q

__all__ = ["BufferLayout", "DecodeMetadata", "EngineBatch", "EngineKV", "FullView", "GpuPlacement",
           "KVBufferSpec", "KeyRanges", "LayerBuffers", "LayerKV", "LogitsRows", "TailCopy",
           "backend_ops", "hit_pages", "key_ranges", "kv_ops", "library", "logits_rows",
           "pack_rows", "quantize", "ragged_to_paged", "rank_gpu", "read_pages", "read_rows",
           "rotate_index_q",
           "shared_gpus_line", "tail_copy", "token_valid_hit", "unpack_rows", "write_pages",
           "write_rows"]


def backend_ops(group: CPGroup, preference: Sequence[str] = ("torch",)) -> OpTable:
    """cpkv's kernels (the indexer, top-k, sparse MLA, fp8 pack, page movers) from the first
    backends in ``preference`` that every rank of ``group`` can run: only for an engine that
    calls cpkv's kernels (or wants cpkv's GPU page movers in :class:`EngineKV`); an engine with
    its own kernels needs none (``EngineKV(spec, group)``).

    A collective: every rank of ``group`` calls it at the same point (the ranks agree on each
    op's backend, one all-reduce)."""
    from cpkv.ops import DSA_OPS
    from cpkv.runtime.setup import resolve_ops
    from cpkv.settings import load_settings

    settings = load_settings(cp={"size": group.size}, backend={"preference": list(preference)})
    return resolve_ops(settings, group, ops=DSA_OPS)[0]
