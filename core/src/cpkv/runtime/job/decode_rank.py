"""The job's decode rank: receives every request from the C prefill ranks through
:class:`~cpkv.runtime.decode.DecodeSession` (the library API an engine calls), then decodes."""

from __future__ import annotations

import time

from cpkv.comm import CPGroup
from cpkv.disagg import page_checksums, select_transport

from ..decode import DecodeSession
from .results import DecodeReport
from .spec import JobSpec, job_model

__all__ = ["decode_rank"]


def decode_rank(world: CPGroup, spec: JobSpec) -> DecodeReport:
    """Endpoint C of the transfer (``world.rank == cp.size``): receive and publish each request
    the prefill ranks send (once per batch and chunk it appears in, until every prompt's final
    part, which carries its first token, arrived), then generate
    ``spec.decode_tokens`` greedy tokens per prompt, starting from the first tokens the prefill
    ranks sent along."""
    s, c = spec.settings, spec.settings.cp.size
    s = spec.holding_all(s, c)  # it keeps every prompt until it generates
    t0 = time.perf_counter()
    decode = DecodeSession(job_model(spec, world.device), s, world.device)
    load_s = time.perf_counter() - t0
    decode.connect(select_transport(s, world.agree_all), cp_size=c)
    got, entries = [0] * c, 0
    first: dict[str, int] = {}
    drafts: dict[str, int] = {}
    crcs: dict[str, list[int]] = {}
    valid: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    # a request arrives once per chunk (the job's batches, and chunked prefill's chunks, whose
    # number depends on the prefill's cache hits); its final part carries its first token
    while len(first) < len(spec.prompts):
        r = decode.receive()
        rid = r.manifest.request
        if s.debug:
            rp = decode.pool.pages.requests[rid]
            crcs[rid] = page_checksums(decode.pool.store, rp.slots)
            ps = decode.pool.fmt.page_size
            valid[rid] = page_checksums(decode.pool.store, rp.slots, [
                min(ps, rp.valid_len - k * ps) for k in range(len(rp.slots))])
        got = [a + b for a, b in zip(got, r.bytes_per_rank, strict=True)]
        entries += r.entries
        if "first_token" in r.meta:
            first[rid] = int(r.meta["first_token"])
        if "draft_token" in r.meta:
            drafts[rid] = int(r.meta["draft_token"])
    receive_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    speculation = None
    if spec.mtp:
        tokens, stats = decode.speculate([(rid, first[rid], drafts[rid]) for rid in spec.rids],
                                         spec.decode_tokens, spec.draft_tokens)
        speculation = stats
    else:
        tokens = decode.generate([(rid, first[rid]) for rid in spec.rids], spec.decode_tokens)
    world.barrier()  # the side channel's store is ours: every prefill rank has read its acks
    return DecodeReport(tokens=tokens, bytes_per_rank=got, entries=entries,
                        seconds={"load": load_s, "receive": receive_s,
                                 "decode": time.perf_counter() - t0}, page_crcs=crcs,
                        valid_crcs=valid, speculation=speculation,
                        kv_layers=decode.pool.num_layers, steps=decode.steps_info())
