"""The DeepSeek-V4 job through the prefix cache (``cpkv run`` with ``cache.v4_prefix``): the
prompts are served in order on the CP ranks, each starting from its snapshot boundary
(:func:`~cpkv.runtime.v4_cache.v4_prefill_cached`); with decode tokens every CP rank sends its
owned entries (the cached prefix's among them) and the tail holder the tail bundle to the decode
rank, as in :mod:`cpkv.runtime.v4_job`. Every endpoint plans the same hits: the decode rank holds
the same tree, without tensors. The checks are the job's: the one-rank forward over each whole
prompt (and over prompt + decoded tokens)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from cpkv.cache.v4_prefix import V4PrefixCache
from cpkv.comm import CPGroup
from cpkv.contracts import SplitMode
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.v4_objects import v4_objects
from cpkv.ops import v4_op_table

from .job.run import job_placement
from .launch import run_ranks
from .v4_cache import V4CachePlan, insert_metadata, plan_cached, v4_prefill_cached
from .v4_job import (
    V4JobReport,
    V4OpsChoice,
    decode_requests,
    first_draft_meta,
    kv_dtype_fallback,
    reference_outputs,
    reference_plan,
    split_drafts,
)
from .v4_prefill import v4_kv_bytes
from .v4_speculative import V4SpeculationStats
from .v4_state import owned_entries, tail_bundle
from .v4_transfer import V4StateSender

if TYPE_CHECKING:
    from cpkv.settings import Settings

__all__ = ["V4CachedJobReport", "run_v4_cached_job"]


@dataclass
class V4CachedJobReport(V4JobReport):
    """The V4 job's report and, per prompt, its hit in tokens, the snapshot boundary it was
    served from and the tokens it computed (``length - boundary``)."""

    hit_tokens: list[int] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    computed_tokens: list[int] = field(default_factory=list)
    snapshot_tokens: int = 0


def _plans(model: DeepseekV4, prompts: list[list[int]], cp: int, page_size: int, mode: str,
           chunk: int, interval: int) -> list[V4CachePlan]:
    """Every prompt's plan, on a cache of metadata only (what every endpoint computes alike)."""
    cache = V4PrefixCache(model.config.ownership_unit(page_size), rank=-1, interval=interval)
    out = []
    for p in prompts:
        plan = plan_cached(model, cache, p, cp, page_size, mode, chunk)
        insert_metadata(cache, p, plan)
        out.append(plan)
    return out


def _rank(world: CPGroup, ckpt: str, prompts: list[list[int]], page_size: int, mode: str,
          chunk: int, interval: int, decode_tokens: int, settings: Settings | None,
          choice: V4OpsChoice
          ) -> (tuple[torch.Tensor, list[int]]
                | tuple[list[list[int]], list[int], V4SpeculationStats | None]):
    """One process: CP ranks return ``(last logits, bytes sent per prompt)`` (with the MTP
    layer the last row's draft logits too: ``[prompts, 2, vocab]``), the decode rank (the last,
    with decode tokens) ``(tokens per prompt, tail bundle bytes per prompt, the speculation's
    counts or None)``."""
    decode = decode_tokens > 0
    c = world.size - 1 if decode else world.size
    model = DeepseekV4.load(ckpt, ops=choice.table(world),
                            mtp=settings is not None and settings.run.mtp)
    plans = _plans(model, prompts, c, page_size, mode, chunk, interval)
    cp_pg = (dist.new_group(list(range(c)), timeout=timedelta(seconds=world.timeout_s))
             if decode else None)
    images, transport = [], None
    if decode:
        from cpkv.disagg import select_transport
        from cpkv.disagg.v4_bundle import V4Image, V4Shapes

        assert settings is not None
        shapes = V4Shapes.of(model)
        transport = select_transport(settings, world.agree_all)
        images = [V4Image.plan(str(i), shapes, pl.layout.entries, len(p), pl.layout.tail_rank)
                  for i, (p, pl) in enumerate(zip(prompts, plans, strict=True))]
    if decode and world.rank == c:
        assert settings is not None and transport is not None
        return decode_requests(world, model, shapes, images, transport, settings, decode_tokens)
    group = (CPGroup.from_process_group(cp_pg, timeout_s=world.timeout_s, device=world.device)
             if cp_pg is not None else world)
    cache = V4PrefixCache(model.config.ownership_unit(page_size), rank=group.rank,
                          interval=interval)
    tx = (V4StateSender(transport, settings, group, max(im.local_pages(group.rank)
                                                        for im in images))
          if decode and transport is not None and settings is not None else None)
    out, sent = [], []
    with torch.no_grad():
        for i, (p, want) in enumerate(zip(prompts, plans, strict=True)):
            logits, plan, carry = v4_prefill_cached(model, torch.tensor(p, dtype=torch.long),
                                                    group, cache, page_size=page_size,
                                                    mode=mode, chunk=chunk)
            assert (plan.hit.hit_tokens, plan.hit.boundary, plan.hit.units, plan.ends) == (
                want.hit.hit_tokens, want.hit.boundary, want.hit.units, want.ends), "plans differ"
            out.append(logits[-1] if not carry.draft_logits
                       else torch.stack([logits[-1], carry.draft_logits[-1][-1]]))
            if tx is not None:
                meta = {"first_token": int(logits[-1].argmax())} | first_draft_meta(carry)
                sent.append(tx.send(shapes, images[i], owned_entries(model, carry, group.rank),
                                    tail_bundle(model, carry), meta).nbytes)
    if tx is not None:
        tx.close()
        world.barrier()  # the decode rank keeps the side channel's store until every ack was read
    return torch.stack(out), sent


def run_v4_cached_job(ckpt: str, prompts: list[list[int]], cp: int, mode: SplitMode | str,
                      page_size: int, chunk: int = 0, timeout_s: float = 600.0, *,
                      snapshot_tokens: int = 0, decode_tokens: int = 0,
                      settings: Settings | None = None, device: str = "cpu",
                      ops: V4OpsChoice | None = None) -> V4CachedJobReport:
    """:func:`~cpkv.runtime.v4_job.run_v4_job` with the prompts served in order through the
    V4 prefix cache (snapshots every ``snapshot_tokens`` and at each prompt's end).

    Raises:
        ValueError: a chunk that is not a multiple of the ownership unit, a window wider than
            the unit, a device other than the CPU.
    """
    if job_placement(device, cp, decode=False).backend != "gloo":
        raise ValueError(f"run.device = {device!r}: the DeepSeek-V4 prefix cache "
                         "(cache.v4_prefix) runs on CPU ranks only; use --device cpu")
    dtype_events = kv_dtype_fallback(settings)
    # the reference: the torch ops on the CPU
    model = DeepseekV4.load(ckpt, ops=v4_op_table(), mtp=settings is not None and settings.run.mtp)
    unit = model.config.ownership_unit(page_size)
    if chunk and chunk % unit:
        raise ValueError(f"runtime.chunk_tokens = {chunk}: DeepSeek-V4 chunks end on ownership "
                         f"units of {unit} tokens; use a multiple of {unit}")
    mode = SplitMode(mode).value
    plans = _plans(model, prompts, cp, page_size, mode, chunk, snapshot_tokens)
    per = [0] * cp
    entries = tail = 0
    for p, plan in zip(prompts, plans, strict=True):
        ranks, rep = v4_kv_bytes(model, plan.layout)
        per = [a + b for a, b in zip(per, ranks, strict=True)]
        entries += rep
        tail += sum(o.bytes_for(len(p)) for o in
                    v4_objects(model.config, mtp=model.mtp_layer is not None)
                    if o.kind != "entries")
    if decode_tokens > 0 and settings is None:
        from cpkv.settings import load_settings

        settings = load_settings()
    t0 = time.perf_counter()
    size = cp + 1 if decode_tokens > 0 else cp
    results = run_ranks(_rank, size, args=(ckpt, prompts, page_size, mode, chunk,
                                           snapshot_tokens, decode_tokens, settings,
                                           ops or V4OpsChoice()),
                        timeout_s=timeout_s)
    seconds = time.perf_counter() - t0
    logits = results[0].value[0]
    tokens: list[list[int]] = []
    bundles: list[int] = []
    sent: list[int] = []
    spec = None
    if decode_tokens > 0:
        tokens, bundles, spec = results[cp].value
        sent = [sum(r.value[1]) for r in results[:cp]]
    which = reference_plan(prompts, decode_tokens, settings)
    ref, ref_tokens = reference_outputs(model, prompts, tokens, which)
    last, last_ref, drafts, drafts_ref = split_drafts(logits, ref)
    return V4CachedJobReport(
        lengths=[len(p) for p in prompts], logits=last, reference=last_ref, rank_bytes=per,
        draft_logits=drafts, draft_reference=drafts_ref, speculation=spec,
        entry_bytes=entries, tail_bytes=tail, seconds=seconds,
        fallbacks=dtype_events + list(results[0].fallbacks), tokens=tokens,
        reference_tokens=ref_tokens,
        bytes_sent=sent, bundle_bytes=bundles, checked=which,
        hit_tokens=[pl.hit.hit_tokens for pl in plans],
        boundaries=[pl.hit.boundary for pl in plans],
        computed_tokens=[len(p) - pl.hit.boundary for p, pl in zip(prompts, plans, strict=True)],
        snapshot_tokens=V4PrefixCache(unit, interval=snapshot_tokens).interval)
