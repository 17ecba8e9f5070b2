"""Run a function on C rank processes of one machine, with every wait bounded.

:func:`run_ranks` spawns ``size`` processes (``spawn`` start method), each of which joins a
``torch.distributed`` process group over TCP on 127.0.0.1 and calls ``fn(group, *args)`` with a
:class:`~cpkv.comm.CPGroup`. It is the test harness for multi-rank code on CPU (Gloo) and
the single-node launcher on GPUs (NCCL).

Rendezvous: the parent creates the ``TCPStore`` server itself on port 0, so the OS picks a free
port that stays bound for the whole run; the ranks connect to it as clients. There is no window
between choosing a port and binding it, hence no race with other processes and nothing to retry.

Bounds: startup (interpreter, imports, rendezvous) is bounded by ``startup_timeout_s``; once every
rank has joined the group, the bound is on silence: when no rank made progress
(:func:`cpkv.comm.note_progress`, which the prefill notes per layer and row chunk and the decode
per step) for ``timeout_s``, every rank is killed and the ones that made none are named. A run
that makes progress is never killed, however long it takes, and a collective waits as long as
that (the process group's timeout is a day's backstop, :data:`SUPERVISED_COLLECTIVE_TIMEOUT_S`:
the group's ``timeout_s``). A rank that raises sends its
traceback; the parent waits ``settle_s`` for other reports (to tell the cause from its echoes,
e.g. a peer's "connection closed"), then terminates every other rank and raises
:class:`RankFailed`. See docs/runtime.md.

Lifetime: every rank dies with the parent, whatever kills it (Linux ``PR_SET_PDEATHSIG``, and a
watchdog thread that sees the parent change); ranks ignore SIGINT (Ctrl-C reaches the whole
process group: the parent alone decides, and terminates them). Logging: with ``log_setup`` each
rank's events travel to the parent through its pipe and are logged there, identical events of
several ranks as one (:mod:`.ranklog`). A rank that sits in one collective for a while tells the
parent (``cpkv.comm.waiting_in``), so a timeout names what each hung rank waits for.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from cpkv._lifetime import PARENT_ENV, die_with_parent
from cpkv.comm import CPGroup, current_wait, last_progress
from cpkv.contracts import FallbackEvent
from cpkv.fallback import recording
from cpkv.logs import ForwardEvents, parent_level

from .ranklog import LogSetup, RankLogMerger, StderrLines, rank_label
from .rankmsg import Failed, Finished, LogEvent, Progressed, RankMessage, Ready, Waiting

__all__ = ["LogSetup", "ProgressSink", "RankFailed", "RankResult", "RankTimeout", "run_ranks"]

#: called in the parent with (rank, what, done, total) when a rank notes progress
#: (:func:`cpkv.comm.note_progress`; ``total`` 0: unknown)
ProgressSink = Callable[[int, str, int, int], None]

HOST = "127.0.0.1"

# Set (setdefault) in every rank: NVLink multicast (NVLS, multimem) off. cpkv's collectives do not
# need it, and on GPUs shared with other tenants (VMs, partitions) a program that uses it can put
# the host's GPUs out of service; a caller who wants it sets these variables itself.
CHILD_ENV_DEFAULTS: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_TERM_GRACE_S = 1.0  # SIGTERM -> SIGKILL
_REAP_S = 1.0  # sentinel closed -> exit status available
#: a rank reports the collective it waits in once it has waited this long (seconds)
_WAIT_REPORT_S = 2.0
#: how often a rank's watchdog looks for new progress to report (seconds)
_PROGRESS_EVERY_S = 0.5
#: the process group's timeout (one collective's bound) of supervised ranks: the launcher bounds
#: silence itself, so a rank waiting for a peer that works is never failed, and one waiting for a
#: hung peer outlives the launcher's bound, which names the rank that hung (a backstop only)
SUPERVISED_COLLECTIVE_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class RankResult:
    """What one rank returned.

    Attributes:
        rank: the rank.
        value: ``fn``'s return value.
        fallbacks: the fallback events reported in the rank while ``fn`` ran (in order).
        seconds: wall time of ``fn`` in the rank.
        startup_seconds: from the parent starting the rank process to ``fn`` starting (the
            interpreter, imports, joining the process group).
    """

    rank: int
    value: Any
    fallbacks: list[FallbackEvent] = field(default_factory=list)
    seconds: float = 0.0
    startup_seconds: float = 0.0


class RankFailed(RuntimeError):
    """A rank raised, or died without a report.

    The message starts with the failing rank's own error (``Type: message``) and includes its
    traceback. Attributes: ``rank``, ``error_type`` (qualified name, or None when the process
    died), ``error_message``, ``traceback_text``, ``exitcode`` (None when the rank reported an
    exception), ``others`` (other ranks' failures seen in the same window, rank -> one line),
    ``label`` (how messages name the rank: "rank 1 of 2", or e.g. "the decode rank (rank 2 of 3)").
    """

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        error_type: str | None = None,
        error_message: str = "",
        traceback_text: str = "",
        exitcode: int | None = None,
        others: Mapping[int, str] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        self.rank = rank
        self.label = rank_label(rank, size, names)
        self.error_type = error_type
        self.error_message = error_message
        self.traceback_text = traceback_text
        self.exitcode = exitcode
        self.others = dict(others or {})
        if error_type is not None:
            head = f"{error_type}: {error_message} [{self.label}]"
        else:
            head = f"{self.label} died without a report: {_describe_exit(exitcode)}"
        parts = [head]
        if traceback_text:
            parts.append(f"--- traceback of {self.label} ---\n{traceback_text.rstrip()}")
        if self.others:
            parts.append(
                "--- other ranks (terminated or failed after it) ---\n"
                + "\n".join(f"{rank_label(r, size, names, short=True)}: {m}"
                            for r, m in sorted(self.others.items()))
            )
        super().__init__("\n".join(parts))


class RankTimeout(RuntimeError):
    """Ranks did not join the group in time (``phase == "startup"``), or no rank made progress
    for ``timeout_s`` (``phase == "run"``: the bound is on silence, not on the run's length);
    they were killed.

    Attributes: ``ranks`` (those that did not finish), ``phase`` (``"startup"`` or ``"run"``),
    ``timeout_s`` (the bound of that phase), ``waiting`` (rank -> the collective it last reported
    waiting in, for ranks that did), ``setting`` (the settings key of the bound, for messages).
    The ranks that wait in no collective are the ones that hung (the others wait for them).
    """

    def __init__(self, ranks: Sequence[int], size: int, phase: str, timeout_s: float, *,
                 names: Sequence[str] | None = None, waiting: Mapping[int, str] | None = None,
                 hint: str = "", last: Mapping[int, str] | None = None) -> None:
        self.ranks = list(ranks)
        self.phase = phase
        self.timeout_s = timeout_s
        self.waiting = {r: w for r, w in (waiting or {}).items() if r in self.ranks}
        self.setting = "runtime.startup_timeout_s" if phase == "startup" else "runtime.timeout_s"
        if names is None:
            names = [f"rank {r}" for r in range(size)]

        def who(rs: Sequence[int]) -> str:
            return ", ".join(rank_label(r, size, names) for r in rs)

        if phase == "startup":
            if hint:  # the fix first, the ranks as ranges (64 labels made a 1,171-character line)
                msg = (f"{hint}. {len(self.ranks)} of {size} ranks did not join the process group "
                       f"within {timeout_s:g} s (ranks {_ranges(self.ranks)}); killed")
                super().__init__(msg)
                return
            msg = f"{who(self.ranks)} did not join the process group within {timeout_s:g} s; killed"
        else:
            hung = [r for r in self.ranks if r not in self.waiting]
            msg = (f"no rank made progress for {timeout_s:g} s ({self.setting}; raise it if one "
                   f"step, e.g. a layer of the longest prompt, takes longer): "
                   f"{who(hung or self.ranks)} made none")
            done = (last or {})
            if hung and any(r in done for r in hung):
                msg += " (last: " + "; ".join(f"{rank_label(r, size, names, short=True)} {done[r]}"
                                              for r in hung if r in done) + ")"
            msg += "; killed"
        if self.waiting:
            msg += " (" + "; ".join(f"{rank_label(r, size, names, short=True)} waited in {w}"
                                    for r, w in sorted(self.waiting.items())) + ")"
        super().__init__(msg + (f". {hint}" if hint else ""))


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit code {exitcode})"
    return f"exit code {exitcode}"


_TRANSPORT_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
# What Gloo raises (as a plain RuntimeError) in a rank whose peer went away.
_TRANSPORT_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport/",
                      "NCCL communicator was aborted", "Broken pipe")


def _is_transport_error(type_name: str, message: str) -> bool:
    """Errors a rank gets because *another* rank went away (echoes, not causes)."""
    if type_name.rsplit(".", 1)[-1] in _TRANSPORT_TYPES:
        return True
    return any(m in message for m in _TRANSPORT_MARKERS)


# -- the rank process -----------------------------------------------------------------------------


_send_lock = threading.Lock()  # the rank's main thread, its watchdog and its log sink share the pipe


def _send(conn: Connection, msg: RankMessage) -> None:
    """Plain pickle, by value: tensors in a result must not travel as shared-memory handles
    (torch's multiprocessing reducers), which die with the rank process that made them."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with _send_lock:
        conn.send_bytes(data)


def _send_quietly(conn: Connection, msg: RankMessage) -> bool:
    """:func:`_send` that returns False instead of raising when the parent is gone (no
    ``BrokenPipeError`` tracebacks from ranks whose parent died)."""
    try:
        _send(conn, msg)
    except (OSError, EOFError):
        return False
    return True


def _watchdog(parent_pid: int, rank: int, conn: Connection) -> None:
    """Daemon thread of a rank: exit when the parent is gone (where there is no parent-death
    signal), tell the parent when the rank made progress (:func:`cpkv.comm.note_progress`: the
    run's bound is on silence, not wall time) and the collective the rank has been waiting in
    for a while (so a timeout can name it; collectives release the GIL while they wait)."""
    told: tuple[int, str] | None = None
    seen = 0
    while True:
        time.sleep(_PROGRESS_EVERY_S)
        if os.getppid() != parent_pid:
            os._exit(1)
        p = last_progress()
        if p.seq != seen:
            seen = p.seq
            if not _send_quietly(conn, Progressed(rank, p.what, p.done, p.total)):
                os._exit(1)
        wait = current_wait()
        msg: Waiting | None = None
        if wait is None:
            if told is not None:  # it moved on: the parent forgets the stale wait
                told, msg = None, Waiting(rank, None)
        else:
            seq, what, since = wait
            if (seq, what) != told and time.monotonic() - since >= _WAIT_REPORT_S:
                told, msg = (seq, what), Waiting(rank, what)
        if msg is not None and not _send_quietly(conn, msg):
            os._exit(1)


def _log_sink(conn: Connection, rank: int) -> Callable[[dict[str, Any]], None]:
    def sink(event: dict[str, Any]) -> None:
        try:
            pickle.dumps(event)
        except Exception:  # values that do not pickle travel as their repr
            event = {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
                     for k, v in event.items()}
        _send_quietly(conn, LogEvent(rank, event))
    return sink


#: CPU threads of a GPU rank's torch ops (its CPU work is per-batch bookkeeping)
GPU_RANK_THREADS = 4


def rank_threads(backend: str, size: int, cpus: int | None = None, *, gpu: bool = False) -> int:
    """torch CPU threads of one of ``size`` rank processes (unless ``OMP_NUM_THREADS`` is set;
    torchrun sets 1): CPU ranks share the cores equally; GPU ranks (NCCL, or ``gpu``) take at
    most :data:`GPU_RANK_THREADS` of their share. C processes with a thread per core each
    oversubscribe the host: on a 32-core two-GPU host CP2's per-batch host phase cost 5x CP1's with 32 threads
    per rank; 16 per rank still left CP1 4-16 % slower and CP2 noisier than 4 (docs/perf.md)."""
    share = max(1, (cpus or os.cpu_count() or 1) // size)
    return min(share, GPU_RANK_THREADS) if gpu or backend == "nccl" else share


def rank_gpus(backend: str, size: int, gpus: Sequence[int] | None,
              found: int) -> list[int | None]:
    """The GPU each of ``size`` ranks computes on (None: the CPU), checked against the ``found``
    GPUs: see :func:`run_ranks`'s ``gpus``.

    Raises:
        ValueError: too few GPUs for NCCL; ``gpus`` of the wrong length, naming a GPU that is not
            there, or (NCCL) one GPU twice.
    """
    if gpus is None:
        if backend != "nccl":
            return [None] * size
        if found < size:
            raise ValueError(f"backend 'nccl' with {size} ranks needs {size} GPUs, found {found}")
        return list(range(size))
    placed = [int(g) for g in gpus]
    if len(placed) != size:
        raise ValueError(f"gpus must place each of the {size} ranks, got {len(placed)}")
    if bad := [g for g in placed if not 0 <= g < found]:
        raise ValueError(f"gpus names GPU(s) {sorted(set(bad))}; this host has {found}")
    if backend == "nccl" and len(set(placed)) != size:
        raise ValueError(f"backend 'nccl' puts one rank on a GPU, got gpus {placed} (ranks that "
                         f"share a GPU need the 'gloo' backend)")
    return [g for g in placed]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    size: int,
    backend: str,
    port: int,
    timeout_s: float,
    args: tuple[Any, ...],
    env: dict[str, str],
    conn: Connection,
    fallback_policy: str = "warn",
    parent_pid: int = 0,
    started_at: float = 0.0,
    log_setup: LogSetup | None = None,
    stderr: Connection | None = None,
    gpu: int | None = None,
) -> None:
    """Entry point of one rank process (top level, so ``spawn`` can pickle it). ``stderr``: the
    write end of a pipe that becomes this process's file descriptor 2 (the parent reads it).
    ``gpu``: the CUDA device this rank computes on (None: the CPU)."""
    if stderr is not None:
        sys.stderr.flush()
        os.dup2(stderr.fileno(), 2)
        stderr.close()
    if parent_pid:
        die_with_parent(parent_pid)  # (cpkv's first import did it too, before torch loaded)
        threading.Thread(target=_watchdog, args=(parent_pid, rank, conn), daemon=True,
                         name="cpkv-rank-watchdog").start()
    # Ctrl-C reaches every process of the terminal's group: the parent stops the ranks
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_setup is not None:
        log_setup(_log_sink(conn, rank))
    for key, value in CHILD_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.update(env)
    if size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(rank_threads(backend, size, gpu=gpu is not None))
    # the launcher bounds silence (timeout_s); a collective waits longer, so that a rank waiting
    # for a hung peer does not fail first and hide which rank hung
    collective_s = max(timeout_s, SUPERVISED_COLLECTIVE_TIMEOUT_S)
    timeout = timedelta(seconds=collective_s)
    msg: Finished | Failed
    try:
        try:
            store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
            device = torch.device("cpu")
            kwargs: dict[str, Any] = {}
            if gpu is not None:
                device = torch.device("cuda", gpu)
                torch.cuda.set_device(device)
                if backend == "nccl":  # Gloo ranks on GPUs: their collectives stay on the host
                    kwargs["device_id"] = device
            dist.init_process_group(
                backend, rank=rank, world_size=size, store=store, timeout=timeout, **kwargs
            )
            group = CPGroup(rank=rank, size=size, backend=backend,  # type: ignore[arg-type]
                            device=device, timeout_s=collective_s)
            _send(conn, Ready(rank))
            startup = time.time() - started_at if started_at else 0.0
            t0 = time.perf_counter()
            with recording(fallback_policy) as rec:
                value = fn(group, *args)
            msg = Finished(rank, value, list(rec.events), time.perf_counter() - t0, startup)
        except BaseException as exc:
            msg = Failed(rank, _qualname(type(exc)), str(exc), traceback.format_exc(), time.time())
        try:
            _send(conn, msg)
        except (OSError, EOFError):
            pass  # the parent is gone: nothing to tell
        except Exception as exc:  # e.g. the return value does not pickle
            _send_quietly(conn, Failed(rank, _qualname(type(exc)),
                                       f"could not send the result of rank {rank} to the parent: "
                                       f"{exc}", traceback.format_exc(), time.time()))
    finally:
        # After the report, so a peer that sees this rank's sockets close (and fails on that)
        # reports later than this rank did.
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        with contextlib.suppress(OSError):
            conn.close()


def _qualname(tp: type) -> str:
    mod = tp.__module__
    return tp.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{tp.__qualname__}"


# -- the parent -----------------------------------------------------------------------------------


def run_ranks(
    fn: Callable[..., Any],
    size: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 60.0,
    settle_s: float = 0.5,
    fallback_policy: str = "warn",
    names: Sequence[str] | None = None,
    log_setup: LogSetup | None = None,
    gpus: Sequence[int] | None = None,
    on_progress: ProgressSink | None = None,
) -> list[RankResult]:
    """Run ``fn(group, *args)`` on ``size`` spawned rank processes; results in rank order.

    Args:
        fn: a picklable top-level function ``fn(group: CPGroup, *args)``; its return value must
            pickle.
        size: number of ranks C (>= 1).
        args: extra positional arguments, pickled to every rank.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r uses ``cuda:r``).
        timeout_s: bound on silence once every rank joined the group: when no rank noted
            progress (:func:`cpkv.comm.note_progress`, e.g. per layer) or finished for this long,
            every rank is killed and :class:`RankTimeout` names the ranks that made none. A
            rank that works is never killed. A collective has a day's backstop
            (:data:`SUPERVISED_COLLECTIVE_TIMEOUT_S`, the group's ``timeout_s``): ranks waiting
            for a hung peer outlast this bound, so the hung one is what gets named.
        env: environment variables set in every rank before the process group is created
            (after ``torch`` is imported; variables read at import time do not see them).
        startup_timeout_s: bound on spawning the ranks and joining the process group.
        fallback_policy: ``"warn"`` or ``"error"``: the fallback policy ``fn`` runs under.
        settle_s: after the first failure, how long to wait for other ranks' reports before
            terminating them (used to tell the failing rank from the peers that fail after it).
        names: what messages call each rank (e.g. ``"the decode rank"``); default "rank r".
        log_setup: a picklable function each rank calls first with a sink (one event dict ->
            the parent): the caller's logging setup for the rank (the CLI's configures structlog
            to hand every event to the sink); what a rank writes to its stderr (fd 2: C++
            libraries such as glog) comes to the parent through a pipe too, one event per line.
            The parent logs each event it receives through
            structlog with the rank in it (``rank=`` or ``ranks=``), identical events of several
            ranks once. Default: :class:`cpkv.logs.ForwardEvents` from this process's level:
            the ranks' events are logged here as this process's own are (standard ``logging``
            unless structlog is configured), nothing printed by the ranks themselves.
        on_progress: called in this process, from the supervising loop, with each progress
            note of a rank (at most one per rank every half second).

    Returns:
        One :class:`RankResult` per rank, in rank order, each with the rank's fallback events.

    Raises:
        RankFailed: a rank raised or died; the message starts with that rank's error.
        RankTimeout: ranks were still running at the deadline (named, with the collective each
            last waited in; all were killed).
        ValueError: bad ``size``/``backend``, ``names`` of the wrong length, or too few GPUs for
            NCCL; ``gpus`` of the wrong length, naming a GPU that is not there, or (NCCL) twice.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if names is not None and len(names) != size:
        raise ValueError(f"names must name each of the {size} ranks, got {len(names)}")
    placed = rank_gpus(backend, size, gpus, torch.cuda.device_count())
    if log_setup is None:  # quiet as a library: the ranks' events come here, logged as ours are
        log_setup = ForwardEvents(parent_level())
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=startup_timeout_s + timeout_s))
    procs: list[Any] = []
    conns: dict[int, Connection] = {}
    logs = RankLogMerger(size, names)
    errs: dict[int, Connection] = {}  # rank -> the read end of its stderr (with log_setup)
    try:
        # SIGINT ignored is inherited through exec: the ranks ignore Ctrl-C from birth; the
        # variable makes their first import of cpkv tie them to this process (cpkv._lifetime)
        with _sigint_ignored(), _env(PARENT_ENV, str(os.getpid())):
            for rank in range(size):
                recv_end, send_end = ctx.Pipe(duplex=False)
                err_write: Connection | None = None
                if log_setup is not None:
                    errs[rank], err_write = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_rank_main,
                    args=(fn, rank, size, backend, store.port, timeout_s, tuple(args),
                          dict(env or {}), send_end, str(fallback_policy), os.getpid(),
                          time.time(), log_setup, err_write, placed[rank]),
                    name=f"cpkv-rank-{rank}",
                    daemon=False,  # fn may start processes of its own; _reap joins every rank
                )
                procs.append(p)
                conns[rank] = recv_end
                try:
                    p.start()
                finally:
                    send_end.close()  # the parent keeps only the read end: EOF when the rank exits
                    if err_write is not None:
                        err_write.close()
        return _Supervisor(procs, conns, size, timeout_s, startup_timeout_s, settle_s, names,
                           logs, errs, on_progress).run()
    finally:
        _reap(procs)
        lines = StderrLines(logs)
        for r in list(errs):
            _drain(errs, r, lines)
        logs.flush(force=True)
        for c in conns.values():
            c.close()
        del store


@contextlib.contextmanager
def _env(key: str, value: str) -> Any:
    """``os.environ[key] = value`` for the block (the processes started in it inherit it)."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@contextlib.contextmanager
def _sigint_ignored() -> Any:
    """SIGINT ignored in this process for the block (only the main thread may set handlers).
    A Ctrl-C that arrives meanwhile is discarded (the kernel drops an ignored signal): the
    price of ranks that ignore it from birth (a blocked mask would not do: a spawned Python
    starts with an empty one). The block is the ranks' start, milliseconds on an idle machine,
    seconds on a loaded one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _oversubscribed_hint(size: int) -> str:
    cpus = os.cpu_count() or 1
    if size <= cpus:
        return ""
    return (f"use fewer ranks or raise runtime.startup_timeout_s: {size} rank processes on "
            f"{cpus} CPU core(s) start slowly")


class _Supervisor:
    """The parent's side of a rank launch: reads each rank's reports (log events, the collective
    it waits in, ready, its result or error), its stderr and its exit, until every rank reported
    a result; after a first failure it waits ``settle_s`` for the other ranks' reports, so that
    the root cause (not a peer's broken pipe) is what gets raised."""

    def __init__(self, procs: list[Any], conns: dict[int, Connection], size: int,
                 timeout_s: float, startup_timeout_s: float, settle_s: float,
                 names: Sequence[str] | None, logs: RankLogMerger | None,
                 errs: dict[int, Connection],
                 on_progress: ProgressSink | None = None) -> None:
        self.procs, self.size, self.names, self.logs, self.errs = procs, size, names, logs, errs
        self.on_progress = on_progress
        #: rank -> its last progress note (what, done, total), for messages
        self.last: dict[int, str] = {}
        self.timeout_s, self.startup_timeout_s, self.settle_s = timeout_s, startup_timeout_s, settle_s
        self.ready: set[int] = set()
        self.results: dict[int, RankResult] = {}
        self.errors: dict[int, tuple[str, str, str, float]] = {}  # rank -> (type, msg, tb, when)
        self.deaths: dict[int, tuple[int | None, float]] = {}  # rank -> (exitcode, when)
        self.waiting: dict[int, str] = {}  # rank -> the collective it last said it waits in
        self.open_conns = dict(conns)
        self.lines = StderrLines(logs) if logs is not None else None
        self.sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        self.deadline = time.monotonic() + startup_timeout_s
        self.phase = "startup"
        self.failed_at: float | None = None

    def done(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors or rank in self.deaths

    def run(self) -> list[RankResult]:
        """Every rank's result, in rank order; raises the first failure's root cause, or
        :class:`RankTimeout`."""
        while len(self.results) < self.size:
            now = time.monotonic()
            if self._settled(now):
                break
            if now >= self.deadline:
                if self.failed_at is not None:
                    break
                raise self._timeout()
            for obj in wait(self._waitables(), timeout=max(0.0, self._limit(now) - now)):
                self._handle(obj)
        if self.errors or self.deaths:
            raise _root_cause(self.errors, self.deaths, self.procs, self.size, self.names)
        self._let_exit()
        return [self.results[r] for r in range(self.size)]

    def _settled(self, now: float) -> bool:
        """After a failure: the settle time is over, or every rank has ended."""
        return self.failed_at is not None and (now >= self.failed_at + self.settle_s
                                               or all(map(self.done, range(self.size))))

    def _timeout(self) -> RankTimeout:
        if self.phase == "startup":
            missing = [r for r in range(self.size) if r not in self.ready]
            return RankTimeout(missing, self.size, self.phase, self.startup_timeout_s,
                               names=self.names, hint=_oversubscribed_hint(self.size))
        return RankTimeout([r for r in range(self.size) if not self.done(r)], self.size,
                           self.phase, self.timeout_s, names=self.names, waiting=self.waiting,
                           last=self.last)

    def _limit(self, now: float) -> float:
        """When to wake up at the latest: the deadline, the settle time, the next log flush."""
        limit = self.deadline if self.failed_at is None else min(self.deadline,
                                                                 self.failed_at + self.settle_s)
        if self.logs is not None:
            self.logs.flush()
            due = self.logs.next_due()
            if due is not None:
                limit = min(limit, due)
        return limit

    def _waitables(self) -> list[Any]:
        objs: list[Any] = list(self.open_conns.values())
        objs += [s for s, r in self.sentinels.items() if not self.done(r)]
        return objs + list(self.errs.values())

    def _handle(self, obj: Any) -> None:
        if isinstance(obj, Connection):
            err_rank = _rank_of(self.errs, obj)
            if err_rank is not None:
                if self.lines is not None:
                    _read_stderr(self.errs, err_rank, self.lines)
                return
            rank = _rank_of(self.open_conns, obj)
            if rank is not None:
                self._read_report(rank, obj)
            return
        rank = self.sentinels.get(obj)
        if rank is not None:
            self._exited(rank)

    def _read_report(self, rank: int, conn: Connection) -> None:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            # The rank exited without (more) reports: watch its sentinel for the exit code.
            del self.open_conns[rank]
            return
        match msg:
            case LogEvent(rank=r, event=event):
                if self.logs is not None:
                    self.logs.add(r, dict(event))
            case Progressed(rank=r, what=what, done=done, total=total):
                self.last[r] = what + (f" ({done:,} of {total:,} tokens)" if total else "")
                self._progressed()
                if self.on_progress is not None:
                    self.on_progress(r, what, done, total)
            case Waiting(rank=r, what=None):
                self.waiting.pop(r, None)
            case Waiting(rank=r, what=str() as what):
                self.waiting[r] = what
            case Ready():
                self.ready.add(rank)
                if self.phase == "startup" and len(self.ready) == self.size:
                    self.phase = "run"
                    if self.failed_at is None:
                        self.deadline = time.monotonic() + self.timeout_s
            case Finished(rank=r):
                self._progressed()
                self.results[r] = RankResult(rank=r, value=msg.value, fallbacks=msg.fallbacks,
                                             seconds=msg.seconds,
                                             startup_seconds=msg.startup_seconds)
            case Failed(rank=r):
                self.errors[r] = (msg.error_type, msg.message, msg.traceback, msg.when)
                self._failed()
            case _:
                raise TypeError(f"rank {rank} sent {type(msg).__name__}, not a RankMessage")

    def _progressed(self) -> None:
        """A rank made progress: the run's bound (on silence) starts again."""
        if self.phase == "run" and self.failed_at is None:
            self.deadline = time.monotonic() + self.timeout_s

    def _exited(self, rank: int) -> None:
        p = self.procs[rank]
        # The sentinel closes a moment before the exit status is reapable.
        p.join(timeout=_REAP_S)
        if rank in self.open_conns and self.open_conns[rank].poll():
            return  # a report is still in the pipe; read it first
        self.open_conns.pop(rank, None)
        if not self.done(rank):
            self.deaths[rank] = (p.exitcode, time.time())
            self._failed()

    def _failed(self) -> None:
        if self.failed_at is None:
            self.failed_at = time.monotonic()

    def _let_exit(self) -> None:
        """Every rank reported a result; let them exit (destroy_process_group) within the
        deadline, reading their stderr meanwhile (a rank blocked on a full pipe would never
        exit)."""
        exiting = {p.sentinel: p for p in self.procs}
        while exiting and time.monotonic() < self.deadline:
            for obj in wait([*exiting, *self.errs.values()],
                            timeout=max(0.0, self.deadline - time.monotonic())):
                if obj in exiting:
                    exiting.pop(obj).join(timeout=_REAP_S)
                elif isinstance(obj, Connection) and self.lines is not None:
                    r = _rank_of(self.errs, obj)
                    if r is not None:
                        _read_stderr(self.errs, r, self.lines)


def _read_stderr(errs: dict[int, Connection], rank: int, lines: StderrLines) -> None:
    """Read what is there of ``rank``'s stderr; at its end, forget the pipe."""
    try:
        data = os.read(errs[rank].fileno(), 1 << 16)
    except OSError:
        data = b""
    lines.feed(rank, data)
    if not data:
        errs.pop(rank).close()


def _drain(errs: dict[int, Connection], rank: int, lines: StderrLines) -> None:
    """Read the rest of ``rank``'s stderr (the rank has exited; a process it started may still
    hold the pipe: read only what is there)."""
    for _ in range(1024):
        if rank not in errs or not errs[rank].poll(0):
            break
        _read_stderr(errs, rank, lines)
    if rank in errs:
        lines.feed(rank, b"")
        errs.pop(rank).close()


def _rank_of(conns: dict[int, Connection], obj: Connection) -> int | None:
    for r, c in conns.items():
        if c is obj:
            return r
    return None


def _root_cause(
    errors: dict[int, tuple[str, str, str, float]],
    deaths: dict[int, tuple[int | None, float]],
    procs: list[Any],
    size: int,
    names: Sequence[str] | None = None,
) -> RankFailed:
    """The failure that caused the others: the earliest one that is not a transport error (a peer
    going away makes the others fail with ``DistBackendError`` & co.); else the earliest."""
    candidates: list[tuple[bool, float, int]] = []
    for r, (etype, emsg, _, when) in errors.items():
        candidates.append((_is_transport_error(etype, emsg), when, r))
    for r, (_, when) in deaths.items():
        candidates.append((False, when, r))
    _, _, rank = min(candidates)
    others: dict[int, str] = {}
    for r, (etype, emsg, _, _) in errors.items():
        if r != rank:
            others[r] = f"{etype}: {emsg.splitlines()[0] if emsg else ''}"
    for r, (code, _) in deaths.items():
        if r != rank:
            others[r] = f"died: {_describe_exit(code)}"
    for r, p in enumerate(procs):
        if r != rank and r not in others and p.exitcode is None:
            others[r] = "still running; terminated"
    if rank in errors:
        etype, emsg, tb, _ = errors[rank]
        return RankFailed(rank, size, error_type=etype, error_message=emsg, traceback_text=tb,
                          others=others, names=names)
    return RankFailed(rank, size, exitcode=deaths[rank][0], others=others, names=names)


def _reap(procs: list[Any]) -> None:
    """Terminate whatever still runs, then kill what ignores SIGTERM; join all (no zombies)."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(Exception):
                p.terminate()
    end = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(Exception):
                p.kill()
            p.join(timeout=5.0)
    for p in procs:
        if p.pid is not None and p.exitcode is not None:
            with contextlib.suppress(Exception):
                p.close()
