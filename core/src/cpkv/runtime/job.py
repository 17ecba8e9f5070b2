"""The main job: CP prefill of prompts on C rank processes, the transfer of their pages to a
non-CP decode rank and greedy decoding there (C + 1 processes in one world), the same prompts on
one rank as the reference (prefill and greedy generation), and a report (KV bytes per rank vs a
replica, transfer bytes per rank, time per phase, fallbacks, correctness).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cpkv.fallback import recording

from .group import CPGroup
from .launch import run_ranks

__all__ = ["DecodeReport", "JobReport", "JobSpec", "RankReport", "SenderReport", "compare_topk",
           "disagg_rank", "prefill_rank", "reference_rank", "run_job"]


@dataclass(frozen=True)
class JobSpec:
    """Everything a rank needs (pickled to every rank process)."""

    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    settings: Any  # cpkv.settings.Settings
    capture_topk: bool = False
    #: tokens of each prompt prefilled in an earlier batch (its KV then comes from the cache;
    #: with a transfer, that batch is a non-final chunk: its whole pages are sent after it)
    prefix_lens: tuple[int, ...] = ()
    #: greedy tokens per prompt on the decode rank (0: no transfer and decode phases)
    decode_tokens: int = 0

    def batches(self) -> list[list[int]]:
        """Tokens of each prompt per prefill batch (0 = not in that batch)."""
        if not any(self.prefix_lens):
            return [[len(p) for p in self.prompts]]
        return [list(self.prefix_lens),
                [len(p) - n for p, n in zip(self.prompts, self.prefix_lens, strict=True)]]


@dataclass
class RankReport:
    rank: int
    last_logits: torch.Tensor
    kv_bytes: int
    kv_bytes_replicated: int
    seconds: dict[str, float]
    #: how the pool built its full views: "all_gather" or "p2p"
    materialize: str = "all_gather"
    topk_indices: list[torch.Tensor] = field(default_factory=list)
    topk_scores: list[torch.Tensor] = field(default_factory=list)


@dataclass
class DecodeReport:
    """What the decode rank hands back."""

    tokens: list[list[int]]
    bytes_per_rank: list[int]
    entries: int
    seconds: dict[str, float]
    #: debug only: request -> CRC32 of each logical page as published (before decoding)
    page_crcs: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SenderReport:
    """What a prefill rank of the disaggregated job hands back."""

    prefill: RankReport
    bytes_sent: int
    entries: int
    seconds: float
    #: the manifests it sent, in order (chunks of one request continue each other)
    manifests: list[Any] = field(default_factory=list)
    #: debug only: request -> {logical page: CRC32} of the pages this rank owns
    page_crcs: dict[str, dict[int, int]] = field(default_factory=dict)


def _rids(spec: JobSpec) -> list[str]:
    return [f"p{i}" for i in range(len(spec.prompts))]


def _prefill_batches(session: Any, spec: JobSpec,
                     after: Callable[[list[tuple[int, bool]], Any], None] = lambda b, r: None) -> Any:
    """Prefill the job's batches (cached prefixes first); ``after(batch, result)`` runs after each
    batch with ``[(prompt index, final chunk?)]``. Returns the last batch's result."""
    rids, done = _rids(spec), [0] * len(spec.prompts)
    batches = spec.batches()
    res = None
    for b, counts in enumerate(batches):
        idx = [i for i, n in enumerate(counts) if n > 0]
        last = b == len(batches) - 1
        res = session.prefill([(rids[i], spec.prompts[i][done[i]:done[i] + counts[i]]) for i in idx],
                              capture_topk=spec.capture_topk and last)
        for i in idx:
            done[i] += counts[i]
        after([(i, done[i] == len(spec.prompts[i])) for i in idx], res)
    return res


def _prefill_session(group: CPGroup, spec: JobSpec) -> tuple[Any, float]:
    from cpkv.models import load_model

    from .session import PrefillSession

    t0 = time.perf_counter()
    model = load_model(spec.model_dir)
    return PrefillSession(model, spec.settings, group), time.perf_counter() - t0


def _rank_report(group: CPGroup, session: Any, res: Any, load_s: float) -> RankReport:
    cap = res.topk
    return RankReport(
        rank=group.rank,
        last_logits=res.last_logits.float().cpu(),
        kv_bytes=session.pool.bytes_held(),
        kv_bytes_replicated=session.pool.replicated_bytes(),
        seconds={"load": load_s, **res.seconds},
        materialize=session.pool.materialize_mode,
        topk_indices=[t.cpu() for t in cap.indices] if cap else [],
        topk_scores=[t.cpu() for t in cap.scores] if cap else [],
    )


def prefill_rank(group: CPGroup, spec: JobSpec) -> RankReport:
    """One rank of the job: load the model, prefill the prompts (cached prefixes first)."""
    session, load_s = _prefill_session(group, spec)
    return _rank_report(group, session, _prefill_batches(session, spec), load_s)


def reference_rank(spec: JobSpec) -> tuple[RankReport, list[list[int]]]:
    """The single-process reference: prefill on one rank, then ``spec.decode_tokens`` greedy
    tokens per prompt with the same batched steps as the decode rank."""
    from .decode import generate, greedy

    session, load_s = _prefill_session(CPGroup.single(), spec)
    first: dict[int, int] = {}

    def keep(batch: list[tuple[int, bool]], res: Any) -> None:
        for (i, _), tok in zip(batch, greedy(res.last_logits), strict=True):
            first[i] = tok

    res = _prefill_batches(session, spec, keep)
    rep = _rank_report(CPGroup.single(), session, res, load_s)
    rids = _rids(spec)
    tokens = (generate(session, [(rids[i], first[i]) for i in range(len(rids))], spec.decode_tokens)
              if spec.decode_tokens else [])
    return rep, tokens


def _transport(settings: Any, world: CPGroup) -> Any:
    """The transfer plugin from settings, selected alike on every process of the world."""
    from cpkv.plugin import PluginHost

    host = PluginHost(disable=settings.plugins.disable, allow=settings.plugins.allow)
    try:
        return host.transfers().select([settings.transfer.name], agree=world.agree_all)["transfer"].impl
    finally:
        host.close()


def disagg_rank(world: CPGroup, spec: JobSpec) -> Any:
    """One process of the disaggregated job (world of C + 1): ranks 0..C-1 prefill on their CP
    group and send their pages after each batch (whole pages after a non-final chunk, the rest
    after the final one); rank C receives, publishes and decodes ``spec.decode_tokens`` tokens.

    Returns: a :class:`SenderReport` on prefill ranks, a :class:`DecodeReport` on the decode rank.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from cpkv.disagg import DecodeTransfer, LinkSpec, PrefillTransfer, manifest_for, page_checksums

    from .decode import DecodeWorker, greedy

    s = spec.settings
    c = s.cp.size
    if world.size != c + 1:
        raise ValueError(f"the disaggregated job needs cp.size + 1 = {c + 1} processes, got {world.size}")
    # collective over the whole world, in the same order everywhere
    cp_pg = dist.new_group(list(range(c)), timeout=timedelta(seconds=s.runtime.timeout_s))
    rids = _rids(spec)
    if world.rank < c:
        group = CPGroup.from_process_group(cp_pg, timeout_s=s.runtime.timeout_s, device=world.device)
        session, load_s = _prefill_session(group, spec)
        link = _transport(s, world).connect(LinkSpec(
            endpoint=world.rank, cp_size=c, pool=session.pool, timeout_s=s.transfer.timeout_s,
            debug=s.debug, options=s.transfer.model_dump(mode="json")))
        sender = PrefillTransfer(link, session.pool, world.rank, c, debug=s.debug)
        sent_pages = dict.fromkeys(rids, 0)
        out = SenderReport(prefill=None, bytes_sent=0, entries=0, seconds=0.0)  # type: ignore[arg-type]
        ps = session.pool.fmt.page_size

        def send(batch: list[tuple[int, bool]], res: Any) -> None:
            for (i, final), tok in zip(batch, greedy(res.last_logits), strict=True):
                rp = session.pages(rids[i])
                m = manifest_for(rids[i], rp.owners, rp.slots, rp.valid_len, ps, c, final=final,
                                 already_sent=sent_pages[rids[i]])
                done = sender.send(m, {"first_token": tok} if final else {})
                sent_pages[rids[i]] = m.num_pages
                out.bytes_sent += done.nbytes
                out.entries += done.entries
                out.seconds += done.seconds
                out.manifests.append(m)

        res = _prefill_batches(session, spec, send)
        out.prefill = _rank_report(group, session, res, load_s)
        if s.debug:
            for rid in rids:
                rp = session.pages(rid)
                mine = [k for k, o in enumerate(rp.owners) if o == world.rank]
                out.page_crcs[rid] = dict(zip(mine, page_checksums(session.pool,
                                                                   [rp.slots[k] for k in mine]),
                                              strict=True))
        return out
    from cpkv.models import load_model

    t0 = time.perf_counter()
    worker = DecodeWorker(load_model(spec.model_dir), s, world.device)
    load_s = time.perf_counter() - t0
    link = _transport(s, world).connect(LinkSpec(
        endpoint=c, cp_size=c, pool=worker.pool, timeout_s=s.transfer.timeout_s, debug=s.debug,
        options=s.transfer.model_dump(mode="json")))
    rx = DecodeTransfer(link, worker.receiver, c)
    got, entries, first, crcs = [0] * c, 0, {}, {}
    t0 = time.perf_counter()
    for counts in spec.batches():
        for _ in (n for n in counts if n > 0):
            r = rx.receive()
            if s.debug:
                rid = r.manifest.request
                crcs[rid] = page_checksums(worker.pool, worker.pool.table[rid].slots)
            got = [a + b for a, b in zip(got, r.bytes_per_rank, strict=True)]
            entries += r.entries
            if "first_token" in r.meta:
                first[r.manifest.request] = int(r.meta["first_token"])
    transfer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = worker.generate([(rid, first[rid]) for rid in rids], spec.decode_tokens)
    return DecodeReport(tokens=tokens, bytes_per_rank=got, entries=entries,
                        seconds={"load": load_s, "receive": transfer_s,
                                 "decode": time.perf_counter() - t0}, page_crcs=crcs)


def compare_topk(a: list[torch.Tensor], sa: list[torch.Tensor], b: list[torch.Tensor],
                 sb: list[torch.Tensor], rel_tie: float = 1e-6) -> int:
    """Rows whose top-k sets differ, ignoring keys whose score ties the k-th within ``rel_tie``.

    a/b: per layer int32 [rows, k] indices; sa/sb: their scores. Returns the count of rows with a
    real difference (0 means the sets are identical up to ties).
    """
    bad = 0
    for ia, xa, ib, xb in zip(a, sa, b, sb, strict=True):
        for r in range(ia.shape[0]):
            pa = {int(i): float(s) for i, s in zip(ia[r], xa[r], strict=True) if i >= 0}
            pb = {int(i): float(s) for i, s in zip(ib[r], xb[r], strict=True) if i >= 0}
            if pa.keys() == pb.keys():
                continue
            floor = min([*pa.values(), *pb.values()])
            tol = rel_tie * max(1.0, abs(floor))
            diff = [pa.get(i, pb.get(i)) for i in pa.keys() ^ pb.keys()]
            if any(abs(s - floor) > tol for s in diff if s is not None):
                bad += 1
    return bad


@dataclass
class JobReport:
    cp: int
    mode: str
    kv_dtype: str
    #: how the sharded pool built its full views ("all_gather" or "p2p", after any fallback)
    materialize: str
    prompt_lens: list[int]
    kv_bytes_per_rank: list[int]
    kv_bytes_replicated: int
    max_rel_err_vs_reference: float
    topk_rows_differing: int | None
    fallbacks: list[dict[str, Any]]
    seconds: dict[str, float]
    logits: torch.Tensor  # float32 [prompts, vocab], CP run, input order
    reference_logits: torch.Tensor
    #: {plugin, bytes_per_rank, entries, seconds}; None without the transfer phase
    transfer: dict[str, Any] | None = None
    #: {tokens, reference_tokens, tokens_match_reference}; None without the decode phase
    decode: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if not isinstance(v, torch.Tensor)}
        return d


def run_job(settings: Any, model_dir: str, prompts: Sequence[Sequence[int]], *,
            prefix_lens: Sequence[int] = (), capture_topk: bool = True, decode_tokens: int = 0,
            progress: Callable[[str], None] = lambda s: None) -> JobReport:
    """CP prefill on ``settings.cp.size`` ranks, then the one-rank reference; compare.

    With ``decode_tokens > 0`` the C prefill ranks and one decode rank run in one world of
    C + 1 processes: the pages move with the transfer plugin ``settings.transfer.name`` and the
    decode rank generates ``decode_tokens`` greedy tokens per prompt, compared with the reference's.

    Raises:
        RankFailed / RankTimeout: a rank failed (its own error) or hung.
    """
    spec = JobSpec(model_dir=model_dir, prompts=tuple(tuple(p) for p in prompts),
                   settings=settings, capture_topk=capture_topk, prefix_lens=tuple(prefix_lens),
                   decode_tokens=decode_tokens)
    c = settings.cp.size
    t = time.perf_counter()
    decode: DecodeReport | None = None
    if decode_tokens > 0:
        progress(f"CP{c} prefill, {settings.transfer.name} transfer and decode on {c + 1} processes")
        results = run_ranks(disagg_rank, c + 1, args=(spec,), timeout_s=settings.runtime.timeout_s,
                            fallback_policy=settings.fallback.policy.value)
        decode = results[c].value
        pre = [(r.rank, r.value.prefill, r.fallbacks) for r in results[:c]]
    else:
        progress(f"CP{c} prefill on {c} rank processes")
        results = run_ranks(prefill_rank, c, args=(spec,), timeout_s=settings.runtime.timeout_s,
                            fallback_policy=settings.fallback.policy.value)
        pre = [(r.rank, r.value, r.fallbacks) for r in results]
    cp_wall = time.perf_counter() - t
    progress("single-rank reference")
    ref_settings = settings.model_copy(update={"cp": settings.cp.model_copy(update={"size": 1})})
    t = time.perf_counter()
    with recording(settings.fallback.policy) as ref_rec:
        ref, ref_tokens = reference_rank(JobSpec(model_dir, spec.prompts, ref_settings, capture_topk,
                                                 spec.prefix_lens, decode_tokens))
    ref_wall = time.perf_counter() - t
    r0 = pre[0][1]
    err = ((r0.last_logits - ref.last_logits).abs().amax(dim=-1)
           / ref.last_logits.abs().amax(dim=-1).clamp_min(1e-30)).max().item()
    topk_bad = (compare_topk(r0.topk_indices, r0.topk_scores, ref.topk_indices, ref.topk_scores)
                if capture_topk else None)
    fallbacks = [{"rank": r, **e.model_dump(mode="json")} for r, _, evs in pre for e in evs]
    if decode is not None:
        fallbacks += [{"rank": "decode", **e.model_dump(mode="json")} for e in results[c].fallbacks]
    fallbacks += [{"rank": "reference", **e.model_dump(mode="json")} for e in ref_rec.events]
    phases = {k: max(v.seconds.get(k, 0.0) for _, v, _ in pre) for k in r0.seconds}
    seconds = {"cp_wall": cp_wall, "reference_wall": ref_wall,
               **{f"cp_{k}": v for k, v in phases.items()}}
    transfer = dec = None
    if decode is not None:
        sent = [r.value.bytes_sent for r in results[:c]]
        if sent != decode.bytes_per_rank:
            raise RuntimeError(f"transfer accounting: prefill ranks sent {sent} bytes, the decode "
                               f"rank received {decode.bytes_per_rank}")
        transfer = {"plugin": settings.transfer.name, "bytes_per_rank": sent,
                    "entries": decode.entries,
                    "seconds": max(r.value.seconds for r in results[:c])}
        dec = {"tokens": decode.tokens, "reference_tokens": ref_tokens,
               "tokens_match_reference": decode.tokens == ref_tokens}
        seconds.update({f"decode_{k}": v for k, v in decode.seconds.items()})
    return JobReport(
        cp=c, mode=settings.cp.mode.value, kv_dtype=settings.kv.dtype.value,
        materialize=r0.materialize,
        prompt_lens=[len(p) for p in prompts],
        kv_bytes_per_rank=[v.kv_bytes for _, v, _ in pre],
        kv_bytes_replicated=r0.kv_bytes_replicated,
        max_rel_err_vs_reference=err, topk_rows_differing=topk_bad, fallbacks=fallbacks,
        seconds=seconds, logits=r0.last_logits, reference_logits=ref.last_logits,
        transfer=transfer, decode=dec)
