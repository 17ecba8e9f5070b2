"""The prefill side's sender worker: one thread per endpoint that moves granted parts, in order,
off the thread that runs the prefill.

A :class:`Stream` is one granted request on one prefill rank. Its sends are queued as jobs
(one per layer with ``transfer.pipeline = "layer"``, one for every layer otherwise) and end with
a :class:`~cpkv.disagg.transport.Done` notice that the worker sends once none of the stream's
writes can still land (every send returned, or failed: a plugin tears a failed engine down
before it raises). A job queued from the layer loop carries the CUDA event recorded after the
layer's KV write: the worker waits for it (a host wait in the worker thread, never in the layer
loop) before it reads the pages. Queued bytes are bounded (``transfer.max_inflight_mb``): a
submit waits while the worker is that far behind.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .plan import RankTransfer, TransferManifest
from .receiver import part_nbytes
from .transport import Done, Link, link_features

if TYPE_CHECKING:
    from cpkv.kv import ShardedKVPool

__all__ = ["SendWorker", "Stream", "overlap"]


@dataclass
class Stream:
    """One granted request on a prefill rank: what it sends and how it went."""

    manifest: TransferManifest
    part: RankTransfer
    dst_slots: list[int]
    epoch: int
    pipeline: str
    #: wall clock (``time.time()``) when the prefill of the batch started (or the send, when
    #: the request was sent after its prefill without that information)
    started: float
    sent: int = 0
    error: str | None = None
    #: why the prefill side gave the stream up (its sends are skipped on a one-sided link; a
    #: two-sided one still sends every granted message: the decode has posted receives for them)
    cancelled: str | None = None
    #: (start, end) wall-clock intervals of this stream's sends
    busy: list[tuple[float, float]] = field(default_factory=list)
    #: set once the worker sent the :class:`Done` (no write of this stream can land any more)
    done: threading.Event = field(default_factory=threading.Event)
    layers_queued: int = 0


def overlap(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the ``busy`` intervals inside ``[start, end]``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in busy)


@dataclass
class _Job:
    stream: Stream
    layers: range | None  # None: the Done notice
    ready: Any = None  # a CUDA event to wait for before reading the pages
    nbytes: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    checksums: list[int] | None = None


class SendWorker:
    """The sender thread of one prefill endpoint (started on first use, a daemon).

    Args:
        link: the endpoint's link (``send_part`` runs on the worker thread only).
        pool: this endpoint's pool.
        rank: this endpoint (0..C-1).
        decode: the decode endpoint (C).
        max_inflight_bytes: queued bytes past which :meth:`submit` waits.
    """

    def __init__(self, link: Link, pool: ShardedKVPool, rank: int, decode: int,
                 max_inflight_bytes: int) -> None:
        self.link, self.pool, self.rank, self.decode = link, pool, rank, decode
        self.features = link_features(link)
        self.limit = max(1, max_inflight_bytes)
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._cv = threading.Condition()
        self._inflight = 0
        self._thread: threading.Thread | None = None
        #: the largest queued bytes seen (tests check the bound)
        self.peak_inflight = 0

    # ---- the producer side (the prefill thread) ------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"cpkv-send-{self.rank}",
                                            daemon=True)
            self._thread.start()

    def submit(self, stream: Stream, layers: range, ready: Any = None) -> None:
        """Queue the send of ``layers`` of ``stream``'s part (waits while the worker is more than
        ``max_inflight_bytes`` behind)."""
        n = part_nbytes(self.pool.store, stream.part.num_pages, layers)
        stream.layers_queued += len(layers)
        if not stream.part.runs:
            return
        self._start()
        with self._cv:
            while self._inflight and self._inflight + n > self.limit:
                self._cv.wait(0.5)
            self._inflight += n
            self.peak_inflight = max(self.peak_inflight, self._inflight)
        self._q.put(_Job(stream, layers, ready, n))

    def finish(self, stream: Stream, meta: Mapping[str, Any] | None = None,
               checksums: list[int] | None = None) -> None:
        """Queue ``stream``'s :class:`Done` after its sends."""
        self._start()
        self._q.put(_Job(stream, None, meta=dict(meta or {}), checksums=checksums))

    def close(self) -> None:
        """Stop the thread after the queued jobs (bounded wait)."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    # ---- the worker thread -------------------------------------------------------------------
    def _fenced(self, epoch: int) -> Callable[[], bool] | None:
        """A one-sided link checks the decode's fence before each batch; a two-sided one sends
        every message the decode may have posted a receive for (it drains them)."""
        channel = self.features.fencing
        if not self.features.one_sided or channel is None:
            return None

        def fenced() -> bool:
            try:
                return bool(channel.fenced(epoch))
            except Exception:
                return False

        return fenced

    def _send(self, job: _Job) -> None:
        s = job.stream
        if s.error is not None:
            return  # a failed stream writes nothing more
        if s.cancelled is not None and self.features.one_sided:
            return
        fenced = self._fenced(s.epoch)
        if fenced is not None and fenced():
            s.error = f"fenced: the decode gave grant {s.epoch} of {s.manifest.request!r} up"
            return
        if job.ready is not None:
            job.ready.synchronize()  # the layer's KV write is done (host wait on this thread)
        t0 = time.time()
        try:
            s.sent += self.link.send_part(s.part, s.dst_slots, layers=job.layers, epoch=s.epoch,
                                          fenced=fenced)
        except Exception as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        finally:
            s.busy.append((t0, time.time()))

    def _loop(self) -> None:
        dev = self.pool.group.device
        if dev.type == "cuda":  # a new thread starts on device 0: this rank's GPU instead
            import torch

            torch.cuda.set_device(dev)
        while True:
            job = self._q.get()
            if job is None:
                return
            s = job.stream
            if job.layers is not None:
                try:
                    self._send(job)
                finally:
                    with self._cv:
                        self._inflight -= job.nbytes
                        self._cv.notify_all()
                continue
            done = Done(s.manifest.request, self.rank, s.epoch, s.sent, s.error or s.cancelled,
                        job.meta, job.checksums)
            with contextlib.suppress(Exception):  # the decode may be gone: it learns by timeout
                self.link.channel.send(self.decode, done)
            s.done.set()
