"""Putting the job's roles together: the rank processes, the reference, the report."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
import torch.distributed as dist

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackEvent
from cpkv.fallback import recording
from cpkv.logs import get_logger
from cpkv.plugin import PluginHost
from cpkv.settings import Settings, SettingsError

from ..launch import LogSetup, ProgressSink, RankResult, run_ranks
from ..setup import has_fp8_tensor_cores
from ..world import launched_world, run_in_world
from .decode_rank import decode_rank
from .prefill_rank import prefill_rank, prefill_sender_rank
from .reference import reference_rank
from .report import DecodeReport, JobReport, RankReport, SenderReport, compare_topk, tail_rows
from .spec import JobSpec

__all__ = [
    "BF16_COMPUTE_TOLERANCE",
    "TIE_TOLERANCE",
    "JobPlacement",
    "check_plugin_names",
    "disagg_rank",
    "job_placement",
    "run_job",
]

log = get_logger(__name__)

#: on GPUs the model computes in bfloat16 (8 mantissa bits), and a CP rank's matmuls over its
#: rows round differently from one GPU's over all rows: logits and indexer scores agree to this
#: (relative) accuracy
BF16_COMPUTE_TOLERANCE = 3e-2
#: top-k keys whose indexer score is this close (relative to the row's scale) to the k-th count
#: as ties when CP and the reference are compared: float32 on CPUs, bfloat16 compute on GPUs
TIE_TOLERANCE = {"cpu": 1e-6, "cuda": BF16_COMPUTE_TOLERANCE}


def disagg_rank(world: CPGroup, spec: JobSpec) -> SenderReport | DecodeReport:
    """One process of the disaggregated job (a world of C + 1): ranks 0..C-1 prefill on their
    CP group and send their pages (:func:`prefill_sender_rank`); rank C receives, publishes and
    decodes (:func:`decode_rank`).

    Raises:
        ValueError: the world does not have ``cp.size + 1`` processes.
    """
    s = spec.settings
    c = s.cp.size
    if world.size != c + 1:
        raise ValueError(f"the disaggregated job needs cp.size + 1 = {c + 1} processes, got {world.size}")
    # a collective over the whole world, in the same order everywhere; on GPUs NCCL (a Gloo
    # world on GPUs: the decode rank shares a prefill rank's GPU, see job_placement)
    # its collectives wait as long as the world's (under cpkv's launcher a backstop: the launcher
    # bounds silence; under torchrun runtime.timeout_s)
    cp_pg = dist.new_group(list(range(c)), timeout=timedelta(seconds=world.timeout_s),
                           backend="nccl" if world.device.type == "cuda" else None)
    if world.rank < c:
        group = CPGroup.from_process_group(cp_pg, timeout_s=world.timeout_s, device=world.device)
        return prefill_sender_rank(world, group, spec)
    return decode_rank(world, spec)


def check_plugin_names(settings: Settings, *, transfer: bool = True) -> None:
    """``backend.name`` (unless "auto") and, with ``transfer``, ``transfer.name`` must each name a
    plugin an installed distribution provides (a backend that is installed but cannot run here,
    or is disabled, is the registry's reported fallback instead); the transfer, which has no
    fallback, must also be available here (its probe: e.g. a missing system library). Checked
    in this process, before any rank starts.

    Raises:
        SettingsError: a name no installed plugin has, with the names there are; a transfer
            that cannot run here, with the probe's reason (and its fix).
    """
    host = PluginHost(disable=settings.plugins.disable, allow=settings.plugins.allow)
    try:
        backends = host.backends()
        wanted = [("backend.name", "backend", settings.backend.name,
                   [*backends.names(), *backends.unusable])]
        if transfer:
            transfers = host.transfers()
            wanted.append(("transfer.name", "transfer", settings.transfer.name,
                           [*transfers.names(), *transfers.unusable]))
        for key, kind, name, names in wanted:
            known = sorted(set(names))
            if name != "auto" and name not in known:
                extra = " or 'auto'" if kind == "backend" else ""
                raise SettingsError(f"{key} = {name!r}: no installed {kind} plugin has that name; "
                                    f"available: {', '.join(known) or 'none'}{extra} "
                                    f"(`cpkv plugins` lists them)")
        if transfer:  # the transfer has no fallback: one that cannot run here fails the job
            av = transfers.availability(settings.transfer.name)
            if not av.available:
                raise SettingsError(f"transfer.name = {settings.transfer.name!r} cannot run here: "
                                    f"{av.reason}")
    finally:
        host.close()


@dataclass(frozen=True)
class JobPlacement:
    """Where the job's processes compute (:func:`job_placement`)."""

    #: "cpu" (Gloo ranks, float32 model) or "cuda" (bfloat16 model)
    device: str
    #: the world's process-group backend: "gloo" or "nccl"
    backend: str
    #: the GPU of each process (the C prefill ranks, then the decode rank); None on CPUs
    gpus: tuple[int, ...] | None = None

    @property
    def shared(self) -> bool:
        """Whether the decode rank shares a GPU with a prefill rank (a Gloo world on GPUs)."""
        return self.gpus is not None and len(set(self.gpus)) < len(self.gpus)


def job_placement(device: str, cp: int, decode: bool, transfer: str = "nccl") -> JobPlacement:
    """``settings.run.device`` resolved for C = ``cp`` prefill ranks and, with ``decode``, the
    decode rank. "auto" is "cuda" when there is a GPU per process. "cuda" takes a GPU per
    process (NCCL world, process r on GPU r) when there are that many; with one GPU fewer (C
    GPUs, C + 1 processes) the decode rank shares GPU 0 with prefill rank 0: the world is Gloo
    (host-memory agreements), the prefill ranks' CP group NCCL, and the pages move with a
    transfer that can reach a process on the same GPU (``mooncake``; not ``nccl``, which puts
    one rank on a GPU).

    Raises:
        ValueError: "cuda" with fewer GPUs than prefill ranks (or than processes, with the
            ``nccl`` transfer or under torchrun), each with the fix.
    """
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    processes = cp + 1 if decode else cp
    if device == "auto":
        device = "cuda" if n >= processes else "cpu"
    if device == "cpu":
        return JobPlacement("cpu", "gloo")
    if n >= processes:
        return JobPlacement("cuda", "nccl", tuple(range(processes)))
    if decode and n >= cp and launched_world() is None:
        if transfer == "nccl":
            raise ValueError(f"run.device = 'cuda' with {n} GPU(s) for {processes} processes (the "
                             f"CP ranks and the decode rank): the decode rank would share GPU 0, "
                             f"which the nccl transfer cannot reach (NCCL puts one rank on a GPU); "
                             f"use transfer.name = 'mooncake' (protocol 'nvlink_intra' moves the "
                             f"pages by CUDA IPC), fewer CP ranks, or --decode-tokens 0")
        return JobPlacement("cuda", "gloo", (*range(cp), 0))
    share = (f" (with transfer.name = 'mooncake' the decode rank can share GPU 0: {cp} GPU(s))"
             if decode and launched_world() is None else "")
    raise ValueError(f"run.device = 'cuda' needs a GPU per process: {processes} processes "
                     f"(the CP ranks{' and the decode rank' if decode else ''}), {n} GPU(s) "
                     f"here{share}; fewer CP ranks, --decode-tokens 0, or device 'cpu'")


def _fallback_rows(pre: Sequence[tuple[int, object, Sequence[FallbackEvent]]],
                   decode: Sequence[FallbackEvent],
                   reference: Sequence[FallbackEvent]) -> list[dict[str, Any]]:
    """The report's fallbacks: each prefill rank's (``pre``: rank, report, events), the decode
    rank's, then the reference's, each tagged with its rank."""
    rows: list[dict[str, Any]] = [{"rank": r, **e.model_dump(mode="json")}
                                  for r, _, evs in pre for e in evs]
    rows += [{"rank": "decode", **e.model_dump(mode="json")} for e in decode]
    rows += [{"rank": "reference", **e.model_dump(mode="json")} for e in reference]
    return rows


def run_job(settings: Settings, model_dir: str, prompts: Sequence[Sequence[int]], *,
            prefix_lens: Sequence[int] = (), capture_topk: bool = True, decode_tokens: int = 0,
            batch_size: int = 0, mtp: bool = False, draft_tokens: int = 1,
            progress: Callable[[str], None] = lambda s: None,
            log_setup: LogSetup | None = None,
            on_progress: ProgressSink | None = None) -> JobReport | None:
    """CP prefill on ``settings.cp.size`` ranks, then the one-rank reference; compare.

    The prompts are served in order, ``batch_size`` per prefill batch (0: all in one); with the
    prefix cache on (``cache.enabled``) each one starts from the longest prefix earlier batches
    left, and the reference computes every prompt whole, without a cache.

    With ``decode_tokens > 0`` the C prefill ranks and one decode rank run in one world of
    C + 1 processes: the pages move with the transfer plugin ``settings.transfer.name`` and the
    decode rank generates ``decode_tokens`` greedy tokens per prompt, compared with the reference's.

    Started by ``torchrun`` (:func:`~cpkv.runtime.world.launched_world`), this process is one
    rank of that world instead of spawning them: the world must have C (+ 1 with decode)
    processes; rank 0 then runs the reference and returns the report, the others return None.

    With ``mtp`` the checkpoint's MTP draft layer runs under CP prefill (the report's ``draft``:
    its last-row logits against the reference's) and the decode rank decodes speculatively with
    ``draft_tokens`` drafts per step (``draft``: accept rate, mean accepted length, steps saved,
    and whether the tokens equal the reference's plain greedy ones).

    ``log_setup`` is handed to the rank launcher (:func:`~cpkv.runtime.launch.run_ranks`): how
    the rank processes log (the CLI sends their events to its own stream); so is
    ``on_progress``, called with each rank's progress notes (tokens done of all per batch and
    chunk; not under torchrun).

    The report's ``seconds``: ``cp_startup`` (spawning the processes, imports, joining the group
    and loading the model: the slowest process), ``cp_prefill`` (every batch, the slowest prefill
    rank), ``cp_decode`` (the decode rank's generation); ``reference_startup`` (its model load,
    in this process), ``reference_prefill``, ``reference_decode``; ``cp_total`` and
    ``reference_total`` (wall); and the detail of the last batch (``cp_plan``, ...) and of the
    decode rank (``decode_load``, ``decode_receive``, ``decode_decode``).

    Raises:
        SettingsError: ``backend.name`` or ``transfer.name`` names no installed plugin.
        RankFailed / RankTimeout: a rank failed (its own error) or hung.
        RuntimeError: the bytes the prefill ranks sent and the decode rank received differ.
        ValueError: under torchrun, a world of the wrong size; ``run.device = "cuda"`` without
            enough GPUs (:func:`job_placement`).
    """
    c = settings.cp.size
    check_plugin_names(settings, transfer=decode_tokens > 0)
    place = job_placement(settings.run.device, c, decode_tokens > 0, settings.transfer.name)
    device = place.device
    # "auto" numeric formats decided once, here, for the processes' device (every rank and the
    # reference then run the same formats; the report says which were taken)
    gpu0 = place.gpus[0] if place.gpus else 0
    settings = settings.resolved(device == "cuda" and has_fp8_tensor_cores(f"cuda:{gpu0}"))
    spec = JobSpec(model_dir=model_dir, prompts=tuple(tuple(p) for p in prompts),
                   settings=settings, capture_topk=capture_topk, prefix_lens=tuple(prefix_lens),
                   decode_tokens=decode_tokens, batch_size=batch_size, device=device, mtp=mtp,
                   draft_tokens=draft_tokens)
    t = time.perf_counter()
    decode: DecodeReport | None = None
    senders: list[SenderReport] = []
    policy = settings.fallback.policy.value
    launched = launched_world()
    need = c + 1 if decode_tokens > 0 else c
    if launched is not None and launched[1] != need:
        raise ValueError(f"torchrun started {launched[1]} processes; this job needs {need} "
                         f"(cp.size = {c}{' + the decode rank' if decode_tokens > 0 else ''})")

    cpus = os.cpu_count() or 1
    # the CP ranks compute together (the decode rank mostly waits): more than a core each is slow
    if launched is None and device == "cpu" and c > cpus:
        log.warning("cpkv.run.oversubscribed", cp_ranks=c, processes=need, cpu_cores=cpus,
                    hint="the ranks share the cores: startup and every collective are slow; "
                         "use fewer CP ranks or raise runtime.startup_timeout_s and "
                         "runtime.timeout_s")

    def ranks(fn: Callable[..., Any], n: int) -> list[RankResult]:
        if launched is not None:  # this process is one rank of the launcher's world
            return run_in_world(fn, args=(spec,), timeout_s=settings.runtime.timeout_s,
                                fallback_policy=policy, device=device)
        names = [f"rank {r}" for r in range(c)] + (["the decode rank"] if n > c else [])
        return run_ranks(fn, n, args=(spec,), timeout_s=settings.runtime.timeout_s,
                         startup_timeout_s=settings.runtime.startup_timeout_s,
                         fallback_policy=policy, backend=place.backend, names=names,
                         log_setup=log_setup, gpus=place.gpus, on_progress=on_progress)

    if decode_tokens > 0:
        progress(f"CP{c} prefill, {settings.transfer.name} transfer and decode on {c + 1} processes"
                 + (f" (the decode rank shares GPU 0 with rank 0: {c} GPU(s) here)"
                    if place.shared else ""))
        results = ranks(disagg_rank, c + 1)
        decode = results[c].value
        senders = [r.value for r in results[:c]]
        pre = [(r.rank, r.value.prefill, r.fallbacks) for r in results[:c]]
    else:
        progress(f"CP{c} prefill on {c} rank processes")
        results = ranks(prefill_rank, c)
        pre = [(r.rank, r.value, r.fallbacks) for r in results]
    cp_wall = time.perf_counter() - t
    if launched is not None and launched[0] != 0:
        return None  # rank 0 checks against the reference and reports
    progress("single-rank reference")
    # whole prompts, unchunked: chunked prefill is checked against the one-piece prefill
    no_cache = spec.holding_all(settings.with_cp_size(1).model_copy(
        update={"cache": settings.cache.model_copy(update={"enabled": False}),
                "runtime": settings.runtime.model_copy(update={"chunk_tokens": 0})}), 1)
    # the reference decodes plain greedy (its draft layer only gives the prefill's draft logits)
    ref_spec = JobSpec(model_dir, spec.prompts, no_cache, capture_topk, spec.prefix_lens,
                       decode_tokens, batch_size, mtp=mtp, device=device)
    t = time.perf_counter()
    # its events name it as the ranks' name theirs (where the caller's logging merges contextvars)
    with recording(settings.fallback.policy) as ref_rec, \
            structlog.contextvars.bound_contextvars(rank="reference"):
        ref, ref_tokens = reference_rank(ref_spec)
    ref_wall = time.perf_counter() - t
    r0: RankReport = pre[0][1]
    err = ((r0.last_logits - ref.last_logits).abs().amax(dim=-1)
           / ref.last_logits.abs().amax(dim=-1).clamp_min(1e-30)).max().item()
    topk_bad = None
    if capture_topk:  # the reference computed whole prompts: compare the rows both computed
        rows = tail_rows(ref.topk_extends, r0.topk_extends)
        topk_bad = compare_topk(r0.topk_indices, r0.topk_scores,
                                [t[rows] for t in ref.topk_indices],
                                [t[rows] for t in ref.topk_scores],
                                rel_tie=TIE_TOLERANCE[device])
    fallbacks = _fallback_rows(pre, results[c].fallbacks if decode is not None else (),
                               ref_rec.events)
    phases = {k: max(v.seconds.get(k, 0.0) for _, v, _ in pre) for k in r0.seconds}
    # startup: from spawning a process to its model being loaded, the slowest process
    starts = [r.startup_seconds + (r.value.prefill if isinstance(r.value, SenderReport)
                                   else r.value).seconds["load"] for r in results[:c]]
    if decode is not None:
        starts.append(results[c].startup_seconds + decode.seconds["load"])
    seconds = {"cp_startup": max(starts), "cp_prefill": phases["prefill"],
               "cp_decode": decode.seconds["decode"] if decode is not None else 0.0,
               "reference_startup": ref.seconds["load"], "reference_prefill": ref.seconds["prefill"],
               "reference_decode": ref.seconds.get("decode", 0.0),
               "cp_total": cp_wall, "reference_total": ref_wall,
               **{f"cp_{k}": v for k, v in phases.items() if k not in ("load", "prefill")}}
    transfer = dec = None
    if decode is not None:
        sent = [r.bytes_sent for r in senders]
        if sent != decode.bytes_per_rank:
            raise RuntimeError(f"transfer accounting: prefill ranks sent {sent} bytes, the decode "
                               f"rank received {decode.bytes_per_rank}")
        # ready: per request, the slowest rank's view (they share the decode's publish time)
        ready = [max(v) for v in zip(*(r.ready_seconds for r in senders), strict=True)]
        transfer = {"plugin": settings.transfer.name, "pipeline": settings.transfer.pipeline,
                    "bytes_per_rank": sent, "entries": decode.entries,
                    "seconds": max(r.seconds for r in senders),
                    "send_seconds": max(r.send_seconds for r in senders),
                    # per rank, its send time that ran while its prefill still computed; the
                    # rank whose sends were hidden least (send - overlap largest) is reported
                    "overlap_seconds": max(senders, key=lambda r: r.send_seconds
                                           - r.overlap_seconds).overlap_seconds,
                    "ready_seconds": sum(ready), "ready_seconds_per_request": ready}
        dec = {"tokens": decode.tokens, "reference_tokens": ref_tokens,
               "tokens_match_reference": decode.tokens == ref_tokens,
               "steps": decode.steps.as_dict() if decode.steps else {}}
        seconds.update({f"decode_{k}": v for k, v in decode.seconds.items()})
    draft = None
    if mtp:
        a, b = r0.draft_logits, ref.draft_logits
        assert a is not None and b is not None
        draft = {"draft_tokens": draft_tokens,
                 "prefill_max_rel_err_vs_reference": ((a - b).abs().amax(dim=-1) / b.abs().amax(
                     dim=-1).clamp_min(1e-30)).max().item()}
        if decode is not None and decode.speculation is not None:
            draft |= decode.speculation | {"tokens_match_reference": decode.tokens == ref_tokens,
                                           "decode_kv_layers": decode.kv_layers}
    cache = None
    if settings.cache.enabled:
        st = r0.cache
        total = sum(len(p) for p in prompts)
        cache = {"enabled": True, "hit_tokens": r0.hits,
                 "hit_fraction": sum(r0.hits) / max(1, total),
                 "pages_evicted": st.get("pages_evicted", 0),
                 "host_pages": settings.cache.host_pages,
                 "pages_saved_to_host": st.get("pages_saved_to_host", 0),
                 "pages_loaded_from_host": st.get("pages_loaded_from_host", 0),
                 "recomputed_tokens": st.get("recomputed_tokens", 0)}
    chunks = None
    if settings.runtime.chunk_tokens:  # per chunk, the slowest rank (they run in lock step)
        chunks = {"chunk_tokens": settings.runtime.chunk_tokens,
                  "seconds_per_batch": [[max(ts) for ts in zip(*per, strict=True)] for per in
                                        zip(*(v.chunk_seconds for _, v, _ in pre), strict=True)]}
    return JobReport(
        cp=c, mode=settings.cp.mode.value, kv_dtype=str(settings.kv.dtype),
        indexer_dtype=settings.runtime.indexer_dtype,
        materialize=r0.materialize, backends=r0.backends,
        prompt_lens=[len(p) for p in prompts],
        kv_bytes_per_rank=[v.kv_bytes for _, v, _ in pre],
        kv_bytes_replicated=r0.kv_bytes_replicated,
        max_rel_err_vs_reference=err, topk_rows_differing=topk_bad, fallbacks=fallbacks,
        seconds=seconds, logits=r0.last_logits, reference_logits=ref.last_logits,
        transfer=transfer, decode=dec, cache=cache, draft=draft, device=device,
        gpus=list(place.gpus) if place.gpus is not None else None,
        logits_budget={"mb_per_rank": [v.logits_budget_mb for _, v, _ in pre],
                       "auto": r0.logits_budget_auto}, chunks=chunks)
