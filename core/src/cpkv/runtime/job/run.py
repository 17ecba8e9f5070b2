"""Putting the job's roles together: the rank processes, the reference, the report."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import structlog
import torch.distributed as dist

from cpkv.comm import CPGroup
from cpkv.fallback import recording
from cpkv.logs import get_logger
from cpkv.plugin import PluginHost
from cpkv.settings import Settings, SettingsError

from ..launch import LogSetup, ProgressSink, RankResult, rank_threads, run_ranks
from ..progress import relayed_progress
from ..setup import has_fp8_tensor_cores
from ..world import launched_world, run_in_world
from .decode_rank import decode_rank
from .prefill_rank import prefill_rank, prefill_sender_rank
from .reference import reference_plan, reference_rank
from .report import JobReport
from .results import CPRun, DecodeReport, PrefillResult, ReferenceRun, SenderReport
from .spec import JobSpec
from .tolerances import DEFAULT_TOLERANCES, Tolerances

__all__ = [
    "JobPlacement",
    "check_plugin_names",
    "cp_run",
    "disagg_rank",
    "job_placement",
    "job_report",
    "job_spec",
    "reference_run",
    "run_job",
]

log = get_logger(__name__)

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
    fixes = (f"--cp {n} or fewer, " if n else "") + ("--decode-tokens 0, " if decode else "") \
        + "or device 'cpu'"
    share = (f" (with transfer.name = 'mooncake' the decode rank can share GPU 0: {cp} GPU(s))"
             if decode and launched_world() is None else "")
    raise ValueError(f"run.device = 'cuda' needs a GPU per process: {processes} processes "
                     f"(the CP ranks{' and the decode rank' if decode else ''}), {n} GPU(s) "
                     f"here{share}; {fixes}")


def job_spec(settings: Settings, model_dir: str, prompts: Sequence[Sequence[int]], *,
             prefix_lens: Sequence[int] = (), capture_topk: bool = True, decode_tokens: int = 0,
             batch_size: int = 0, mtp: bool = False, draft_tokens: int = 1
             ) -> tuple[JobSpec, JobPlacement]:
    """The job's spec (its settings resolved for the processes' device) and where its processes
    compute, checked before any rank starts (see :func:`run_job`).

    Raises:
        SettingsError: ``backend.name`` or ``transfer.name`` names no installed plugin.
        ValueError: under torchrun, a world of the wrong size; ``run.device = "cuda"`` without
            enough GPUs.
    """
    c = settings.cp.size
    check_plugin_names(settings, transfer=decode_tokens > 0)
    place = job_placement(settings.run.device, c, decode_tokens > 0, settings.transfer.name)
    # "auto" numeric formats decided once, here, for the processes' device (every rank and the
    # reference then run the same formats; the report says which were taken)
    gpu0 = place.gpus[0] if place.gpus else 0
    settings = settings.resolved(place.device == "cuda"
                                 and has_fp8_tensor_cores(f"cuda:{gpu0}"))
    spec = JobSpec(model_dir=model_dir, prompts=tuple(tuple(p) for p in prompts),
                   settings=settings, capture_topk=capture_topk, prefix_lens=tuple(prefix_lens),
                   decode_tokens=decode_tokens, batch_size=batch_size, device=place.device,
                   mtp=mtp, draft_tokens=draft_tokens)
    launched = launched_world()
    need = c + 1 if decode_tokens > 0 else c
    if launched is not None and launched[1] != need:
        raise ValueError(f"torchrun started {launched[1]} processes; this job needs {need} "
                         f"(cp.size = {c}{' + the decode rank' if decode_tokens > 0 else ''})")
    cpus = os.cpu_count() or 1
    # the CP ranks compute together (the decode rank mostly waits): more than a core each is slow
    if launched is None and place.device == "cpu" and c > cpus:
        log.warning("cpkv.run.oversubscribed", cp_ranks=c, processes=need, cpu_cores=cpus,
                    hint="the ranks share the cores: startup and every collective are slow; "
                         "use fewer CP ranks or raise runtime.startup_timeout_s and "
                         "runtime.timeout_s")
    return spec, place


def cp_run(spec: JobSpec, place: JobPlacement, *,
           progress: Callable[[str], None] = lambda s: None, log_setup: LogSetup | None = None,
           on_progress: ProgressSink | None = None) -> CPRun:
    """The CP prefill ranks (and, with ``spec.decode_tokens``, the decode rank: one world of
    C + 1 processes) of the job: spawned here, or, under torchrun, this process as one of them.

    Raises:
        RankFailed / RankTimeout: a rank failed (its own error) or hung.
    """
    settings, c = spec.settings, spec.settings.cp.size
    policy = settings.fallback.policy.value
    decode = spec.decode_tokens > 0
    n = c + 1 if decode else c
    fn = disagg_rank if decode else prefill_rank
    if decode:
        progress(f"CP{c} prefill, {settings.transfer.name} transfer and decode on {c + 1} processes"
                 + (f" (the decode rank shares GPU 0 with rank 0: {c} GPU(s) here)"
                    if place.shared else ""))
    else:
        progress(f"CP{c} prefill on {c} rank processes")
    t = time.perf_counter()
    results: list[RankResult]
    if launched_world() is not None:  # this process is one rank of the launcher's world
        results = run_in_world(fn, args=(spec,), timeout_s=settings.runtime.timeout_s,
                               fallback_policy=policy, device=place.device)
    else:
        names = [f"rank {r}" for r in range(c)] + (["the decode rank"] if decode else [])
        results = run_ranks(fn, n, args=(spec,), timeout_s=settings.runtime.timeout_s,
                            startup_timeout_s=settings.runtime.startup_timeout_s,
                            fallback_policy=policy, backend=place.backend, names=names,
                            log_setup=log_setup, gpus=place.gpus, on_progress=on_progress)
    wall = time.perf_counter() - t
    senders = tuple(r.value for r in results[:c]) if decode else ()
    prefill = tuple(PrefillResult(r.rank, r.value.prefill if decode else r.value,
                                  tuple(r.fallbacks), r.startup_seconds) for r in results[:c])
    if not decode:
        return CPRun(prefill=prefill, wall_seconds=wall)
    last = results[c]
    return CPRun(prefill=prefill, wall_seconds=wall, senders=senders, decode=last.value,
                 decode_fallbacks=tuple(last.fallbacks),
                 decode_startup_seconds=last.startup_seconds)


def reference_run(spec: JobSpec, on_progress: ProgressSink | None = None
                  ) -> ReferenceRun | None:
    """The job's reference (``run.reference``, :func:`~.reference.reference_plan`) on one rank,
    in this process, on the job's device with its backends: its prompts (whole, or their first
    ``run.reference_tokens`` with "sample") without a cache, in the job's chunks (chunking and
    the cache change no logit and no top-k choice); greedy decoding plain for the prompts
    computed whole (its draft layer only gives the prefill's draft logits). ``on_progress``
    gets its progress as rank 0's "reference prefill" and "reference decode" (tokens done of
    all, at most every half second). None with ``run.reference = "off"``."""
    plan = reference_plan(spec)
    if plan.spec is None:
        return None
    s = spec.settings
    t = time.perf_counter()
    # its events name it as the ranks' name theirs (where the caller's logging merges contextvars)
    with recording(s.fallback.policy) as rec, \
            structlog.contextvars.bound_contextvars(rank="reference"), \
            relayed_progress(on_progress, prefix="reference "), _cpu_threads(spec):
        rep, tokens = reference_rank(plan.spec, [i for i, w in enumerate(plan.whole) if w])
    return ReferenceRun(report=rep, tokens=tokens, fallbacks=tuple(rec.events),
                        wall_seconds=time.perf_counter() - t, mode=plan.mode,
                        lengths=plan.lengths, whole=plan.whole,
                        last_batch=tuple(i for i, n in enumerate(spec.batches()[-1]) if n))


@contextmanager
def _cpu_threads(spec: JobSpec) -> Iterator[None]:
    """On CPUs, the reference computes with the torch threads a CP rank had (the cores shared
    by the C ranks, at least one; unless ``OMP_NUM_THREADS`` is set): torch's default, a thread
    per core, made a 4,096-token one-piece prefill 7-11x slower than one thread on a 2-core
    machine that other processes kept busy (each parallel op waits for its slowest thread),
    and so the reference of a 65,536-token prompt ran for 20 minutes after a 7-minute CP run."""
    import torch

    if spec.device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(rank_threads("gloo", spec.settings.cp.size))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def job_report(spec: JobSpec, place: JobPlacement, cp: CPRun, ref: ReferenceRun | None,
               tolerances: Tolerances = DEFAULT_TOLERANCES) -> JobReport:
    """The report of the CP run against the reference (:meth:`JobReport.of`).

    Raises:
        RuntimeError: the bytes the prefill ranks sent and the decode rank received differ.
    """
    return JobReport.of(spec.settings, spec.prompts, cp, ref, capture_topk=spec.capture_topk,
                        mtp=spec.mtp, draft_tokens=spec.draft_tokens, device=place.device,
                        gpus=place.gpus, tolerances=tolerances)


def run_job(settings: Settings, model_dir: str, prompts: Sequence[Sequence[int]], *,
            prefix_lens: Sequence[int] = (), capture_topk: bool = True, decode_tokens: int = 0,
            batch_size: int = 0, mtp: bool = False, draft_tokens: int = 1,
            progress: Callable[[str], None] = lambda s: None,
            log_setup: LogSetup | None = None,
            on_progress: ProgressSink | None = None,
            tolerances: Tolerances = DEFAULT_TOLERANCES) -> JobReport | None:
    """CP prefill on ``settings.cp.size`` ranks, then the one-rank reference
    (``run.reference``: "full", "sample" or "off"; :func:`reference_run`); compare.

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
    ``on_progress``, called with each rank's progress notes (tokens done of all, per layer and
    indexer row chunk; not under torchrun) and the reference's (rank 0's "reference prefill"
    and "reference decode").

    The report's :meth:`~JobReport.verdict` (pass or fail, with the failures) is what
    ``cpkv run`` prints and exits with; ``tolerances``: the top-k comparison's ties. Its
    ``seconds``: :class:`~cpkv.runtime.job.sections.Seconds`. The steps: :func:`job_spec`,
    :func:`cp_run`, :func:`reference_run`, :func:`job_report`.

    Raises:
        SettingsError: ``backend.name`` or ``transfer.name`` names no installed plugin.
        RankFailed / RankTimeout: a rank failed (its own error) or hung.
        RuntimeError: the bytes the prefill ranks sent and the decode rank received differ.
        ValueError: under torchrun, a world of the wrong size; ``run.device = "cuda"`` without
            enough GPUs (:func:`job_placement`).
    """
    spec, place = job_spec(settings, model_dir, prompts, prefix_lens=prefix_lens,
                           capture_topk=capture_topk, decode_tokens=decode_tokens,
                           batch_size=batch_size, mtp=mtp, draft_tokens=draft_tokens)
    cp = cp_run(spec, place, progress=progress, log_setup=log_setup, on_progress=on_progress)
    launched = launched_world()
    if launched is not None and launched[0] != 0:
        return None  # rank 0 checks against the reference and reports
    if spec.settings.run.reference != "off":
        progress("single-rank reference")
    ref = reference_run(spec, on_progress)
    return job_report(spec, place, cp, ref, tolerances)
