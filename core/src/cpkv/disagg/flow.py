"""The transfer protocol, driven by the core over any :class:`~cpkv.disagg.transport.Link`.

Per request (one :class:`TransferManifest`, identical on every prefill rank):

1. every prefill rank r -> decode: :class:`Offer` (manifest, its byte count, the pipeline, debug
   checksums);
2. decode: checks the offers agree, reserves slots (all or nothing) -> every rank:
   :class:`Grant` (its destination slots and the grant's epoch, or the refusal: then every side
   raises, nothing moved);
3. every rank's sender worker moves its part (after the prefill, or layer by layer during it:
   ``transfer.pipeline``), then sends :class:`Done`; decode: ``link.recv_part`` per part and
   layer group (two-sided links), then every rank's :class:`Done`;
4. decode: ``DecodeReceiver.complete`` (counts; checksums under debug) -> every rank:
   :class:`Ack`. A failure at any step gives the reservation up: nothing is published, and
   with a one-sided link the slots stay in quarantine until every sender that may still write
   them sent its (late) :class:`Done` (docs/transfer.md, "Late writes").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from cpkv.comm import note_progress
from cpkv.kv import PoolExhausted, RequestPages, ShardedKVPool

from .errors import TransferError, TransferRefused
from .plan import RankTransfer, TransferManifest, manifest_for
from .receiver import DecodeReceiver, page_checksums, part_nbytes
from .sender import SendWorker, Stream, overlap
from .transport import Ack, Done, Grant, Link, Offer, link_features

__all__ = ["PIPELINES", "DecodeTransfer", "PrefillTransfer", "Received", "Sent"]

#: ``transfer.pipeline``: one send per request after its prefill, or one per layer during it
PIPELINES = ("request", "layer")


@dataclass(frozen=True)
class Sent:
    """One request's transfer as a prefill rank saw it."""

    request: str
    nbytes: int
    entries: int  # coalesced page runs sent (each one entry per layer and buffer)
    seconds: float
    #: what was sent (identical on every prefill rank)
    manifest: TransferManifest
    pipeline: str = "request"
    #: prefill start (or send start) -> the decode published it
    ready_seconds: float = 0.0
    #: seconds of this rank's sends that ran while the prefill still computed
    overlap_seconds: float = 0.0
    #: seconds this rank's sends took in all
    send_seconds: float = 0.0


@dataclass(frozen=True)
class Received:
    """One published request on the decode rank."""

    manifest: TransferManifest
    bytes_per_rank: list[int]
    entries: int
    seconds: float
    meta: Mapping[str, Any] = field(default_factory=dict)
    pipeline: str = "request"
    #: wall clock (``time.time()``) of the publish
    published_at: float = 0.0


def _part_of(manifest: TransferManifest, rank: int) -> RankTransfer:
    return next((p for p in manifest.parts if p.rank == rank),
                RankTransfer(request=manifest.request, rank=rank, runs=()))


def _src_slots(part: RankTransfer) -> list[int]:
    return [r.src_slot + i for r in part.runs for i in range(r.num_pages)]


class PrefillTransfer:
    """The sending side on prefill CP rank ``rank`` (endpoint ``rank`` of ``link``).

    :meth:`send_request` sends a request's pages from the pool's page table after its prefill
    and remembers how many pages of it were sent, so the chunks of a chunked prefill continue
    each other; :meth:`send` sends a manifest built elsewhere. With the layer pipeline an engine
    opens the batch's requests before the layer loop (:meth:`open_request`), calls
    :meth:`layer_written` after each layer's KV write and :meth:`finish` after the batch.
    The bytes move on a :class:`~cpkv.disagg.sender.SendWorker` thread.
    """

    def __init__(self, link: Link, pool: ShardedKVPool, rank: int, cp_size: int, *,
                 debug: bool = False, max_inflight_bytes: int = 256 << 20) -> None:
        self.link, self.pool, self.rank, self.cp_size, self.debug = link, pool, rank, cp_size, debug
        #: request -> logical pages already sent (by earlier chunks)
        self.sent_pages: dict[str, int] = {}
        self.worker = SendWorker(link, pool, rank, cp_size, max_inflight_bytes)
        #: streams opened for the layer pipeline and not finished yet, in order
        self.open: dict[str, Stream] = {}

    # ---- request pipeline: everything after the prefill ---------------------------------------
    def send_request(self, request: Hashable, pages: RequestPages, *, final: bool = True,
                     meta: Mapping[str, Any] | None = None, started: float | None = None) -> Sent:
        """Send the pages of ``request`` (page table ``pages``) not sent before: after a non-final
        chunk only its whole pages (rule 26), after the final one the rest, tail page included.
        Every prefill rank calls it with the same arguments; returns once decode published.
        A request opened with :meth:`open_request` (layer pipeline) is finished instead.
        ``started``: the wall clock (``time.time()``) of its prefill's start, for
        ``Sent.ready_seconds`` (default: now).

        Raises:
            TransferError: the decode rank refused or did not publish the request (nothing of
                this call counts as sent then).
        """
        rid = str(request)
        if rid in self.open:
            return self.finish(rid, meta)
        m = self.manifest(rid, pages, final)
        done = self.send(m, meta, started=started)
        self._sent(rid, m, final)
        return done

    def manifest(self, request: Hashable, pages: RequestPages, final: bool) -> TransferManifest:
        """The manifest of the pages of ``request`` not sent before (see :meth:`send_request`)."""
        rid = str(request)
        return manifest_for(rid, pages, self.pool.fmt.page_size, self.cp_size, final=final,
                            already_sent=self.sent_pages.get(rid, 0), layout=self.pool.store.layout)

    def _sent(self, rid: str, m: TransferManifest, final: bool) -> None:
        if final:
            self.sent_pages.pop(rid, None)
        else:
            self.sent_pages[rid] = m.num_pages

    def _unsent(self, m: TransferManifest) -> None:
        """A layer-pipelined send counted at open did not publish: its pages count as unsent."""
        if m.first_page:
            self.sent_pages[m.request] = m.first_page
        else:
            self.sent_pages.pop(m.request, None)

    def send(self, manifest: TransferManifest, meta: Mapping[str, Any] | None = None, *,
             started: float | None = None) -> Sent:
        """Send this rank's part of ``manifest`` (every prefill rank calls it with the same
        manifest). Returns after the decode rank published the request.

        Raises:
            TransferError: the decode rank refused or did not publish the request.
        """
        end = time.time()
        if self.pool.store.loads_pending:  # pages a cache hit brought back from the host, in place first
            self.pool.store.flush_loads()
        s = self._offer(manifest, "request", end if started is None else started, meta)
        ready = None
        if self.pool.group.device.type == "cuda":  # the prefill's last writes may still run
            import torch

            ready = torch.cuda.Event()
            ready.record()
        self.worker.submit(s, range(self.pool.num_layers), ready)
        return self._conclude(s, None, end)

    def cancel(self, why: str) -> None:
        """The prefill of the open (layer-pipelined) requests failed: their queued sends are
        skipped and their :class:`Done` says ``why`` (the decode gives them up at once); returns
        once the sender worker is past them (bounded), so the batch's pages can be reused."""
        streams = list(self.open.values())
        self.open.clear()
        for s in streams:
            s.cancelled = why
            self._unsent(s.manifest)
            if s.layers_queued < self.pool.num_layers:  # a two-sided link sends them anyway
                self.worker.submit(s, range(s.layers_queued, self.pool.num_layers))
            self.worker.finish(s)
        for s in streams:
            s.done.wait(self.link_timeout())
        for _ in streams:  # the decode's (negative) verdicts keep the side channel in step
            with contextlib.suppress(Exception):
                self.link.channel.recv(self.cp_size)

    def link_timeout(self) -> float:
        """The bound of one wait on the link's side channel, seconds."""
        return float(self.link.channel.timeout_s)

    # ---- layer pipeline: sends during the prefill -----------------------------------------------
    def open_request(self, request: Hashable, pages: RequestPages, *, final: bool,
                     started: float) -> Stream:
        """Offer ``request``'s pages (the batch's page table, reserved but not yet written) to the
        decode and take its grant, before the layer loop; its layers then move as
        :meth:`layer_written` is called. ``started``: the batch's prefill start
        (``time.time()``).

        Raises:
            TransferRefused: the decode refused the request (nothing will move).
        """
        rid = str(request)
        m = self.manifest(rid, pages, final)
        s = self._offer(m, "layer", started, None)
        self.open[rid] = s
        self._sent(rid, m, final)
        return s

    def layer_written(self, layer: int, ready: Any = None) -> None:
        """Layer ``layer``'s KV of the open requests is written (on GPUs ``ready`` is a CUDA
        event recorded after the write on the compute stream: nothing here waits for it):
        queue its pages' sends."""
        for s in self.open.values():
            if s.layers_queued == layer:
                self.worker.submit(s, range(layer, layer + 1), ready)

    def finish(self, request: Hashable, meta: Mapping[str, Any] | None = None,
               prefill_end: float | None = None) -> Sent:
        """End ``request``'s layer-pipelined send (every layer queued): its :class:`Done` with
        ``meta``, then the decode's verdict.

        Raises:
            TransferError: not every layer was queued, or the decode did not publish it.
        """
        s = self.open.pop(str(request), None)
        if s is None:
            raise TransferError(f"request {request!r} has no layer-pipelined send open")
        if s.layers_queued != self.pool.num_layers:
            self.worker.submit(s, range(s.layers_queued, self.pool.num_layers))
        sums = None
        if self.debug:  # every layer is written by now; the checksums cover every layer
            sums = page_checksums(self.pool.store, _src_slots(s.part))
        try:
            return self._conclude(s, meta, prefill_end if prefill_end is not None else time.time(),
                                  sums)
        except TransferError:
            self._unsent(s.manifest)
            raise

    # ---- both ----------------------------------------------------------------------------------
    def _offer(self, manifest: TransferManifest, pipeline: str, started: float,
               meta: Mapping[str, Any] | None) -> Stream:
        part = _part_of(manifest, self.rank)
        sums = (page_checksums(self.pool.store, _src_slots(part))
                if self.debug and pipeline == "request" else None)
        decode = self.cp_size
        self.link.channel.send(decode, Offer(self.rank, manifest,
                                             part_nbytes(self.pool.store, part.num_pages), sums,
                                             dict(meta or {}), pipeline))
        grant: Grant = self.link.channel.recv(decode)
        if grant.error is not None or grant.dst_slots is None:
            raise TransferRefused(f"decode refused request {manifest.request!r}: {grant.error}")
        return Stream(manifest, part, list(grant.dst_slots), grant.epoch, pipeline, started)

    def _conclude(self, s: Stream, meta: Mapping[str, Any] | None, prefill_end: float,
                  sums: list[int] | None = None) -> Sent:
        """Queue the Done, wait for the decode's Ack (it comes after every rank's Done, or when
        the decode gave the request up: the worker may then still be sending; its Done follows
        late and releases the quarantine)."""
        self.worker.finish(s, meta, sums)
        ack: Ack = self.link.channel.recv(self.cp_size)
        m = s.manifest
        if not ack.published:
            if s.error is not None or s.cancelled is not None:
                raise TransferError(f"rank {self.rank} failed writing its part of {m.request!r} "
                                    f"({s.part.num_pages} pages): {s.error or s.cancelled}; decode: "
                                f"{ack.error}")
            raise TransferError(f"decode did not publish request {m.request!r}: {ack.error}")
        busy = sum(b - a for a, b in s.busy)
        return Sent(m.request, s.sent, len(s.part.runs), time.time() - s.started, m, s.pipeline,
                    ready_seconds=max(0.0, ack.published_at - s.started),
                    overlap_seconds=overlap(s.busy, s.started, prefill_end),
                    send_seconds=busy)

    def close(self) -> None:
        """Stop the sender thread (after its queued jobs)."""
        self.worker.close()


@dataclass
class _Arrival:
    """One granted request on the decode rank while its parts arrive."""

    manifest: TransferManifest
    offers: list[Offer]
    epoch: int
    #: (layer group, part) receives a two-sided link still has to make, in the senders' order
    todo: list[tuple[range, RankTransfer]]
    #: bytes arrived per rank
    got: list[int]
    #: each rank's completion notice, once it came
    done: dict[int, Done] = field(default_factory=dict)
    #: the rank whose part was being received (for the error message)
    current: int = -1

    @property
    def pipeline(self) -> str:
        return self.offers[0].pipeline


class DecodeTransfer:
    """The receiving side on the decode rank (endpoint C of ``link``).

    Attributes:
        late: :class:`Done` notices of given-up grants that arrived later (each released that
            sender's hold on the quarantined slots).
        features: the link's capabilities (resolved once, here).
    """

    def __init__(self, link: Link, receiver: DecodeReceiver, cp_size: int) -> None:
        self.link, self.receiver, self.cp_size = link, receiver, cp_size
        self.features = link_features(link)
        self.late: list[Done] = []

    def _tell_all(self, msg: Any, best_effort: bool = False) -> None:
        for r in range(self.cp_size):
            try:
                self.link.channel.send(r, msg)
            except Exception:
                if not best_effort:
                    raise

    def _recv(self, rank: int, epoch: int | None = None) -> Any:
        """The next message from ``rank`` that is not a late :class:`Done` of another grant
        (those release the sender's hold on a quarantined reservation and are skipped)."""
        while True:
            msg = self.link.channel.recv(rank)
            if isinstance(msg, Done) and msg.epoch != epoch:
                self.receiver.sender_done(msg.epoch, msg.rank)
                self.late.append(msg)
                continue
            return msg

    def _await_quarantine(self) -> bool:
        """The pool is full and slots are in quarantine: wait (each wait bounded by the link's
        timeout) for the late notices of the senders they wait for: between requests the next
        message of such a sender can only be its late :class:`Done`. Returns whether slots came
        back."""
        before = sum(len(q[1]) for q in self.receiver.quarantined().values())
        pending = sorted({r for _, _, rs in self.receiver.quarantined().values() for r in rs})
        for r in pending:
            try:
                msg = self.link.channel.recv(r)
            except Exception:
                return False
            if not isinstance(msg, Done):
                raise TransferError(f"rank {r} sent {type(msg).__name__} while the decode waited "
                                    f"for its late completion notice")
            self.receiver.sender_done(msg.epoch, msg.rank)
            self.late.append(msg)
        return sum(len(q[1]) for q in self.receiver.quarantined().values()) < before

    def _done(self, rank: int, epoch: int, request: str) -> Done:
        try:
            msg = self._recv(rank, epoch)
        except Exception as exc:
            raise TransferError(f"no completion notice from rank {rank} (waited at most "
                                f"{self.link.channel.timeout_s:g} s of silence, transfer.timeout_s): "
                                f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(msg, Done) or (msg.request, msg.rank) != (request, rank):
            raise TransferError(f"rank {rank} sent {msg!r}, expected the completion notice of "
                                f"its part of {request!r}")
        return msg

    def receive(self) -> Received:
        """Receive, assemble and publish the next request.

        Raises:
            TransferRefused: refused before anything moved (pool exhausted, inconsistent offers,
                a manifest that does not continue the request); nothing reserved.
            TransferError: a transport failure, or the parts did not check out; nothing was
                published and the reservation is gone (or, with a one-sided link, in quarantine
                until its senders are done).
        """
        offers: list[Offer] = [self._recv(r) for r in range(self.cp_size)]
        t0 = time.perf_counter()
        m = offers[0].manifest
        slots = self._reserve(m, self._offer_problem(offers))
        run = self._grant(m, offers, slots)
        try:
            self._arrive(run)
        except Exception as exc:
            self._give_up(run, exc)
        return self._publish(run, t0)

    # ---- the steps of receive ------------------------------------------------------------------
    def _offer_problem(self, offers: list[Offer]) -> str | None:
        """Why the offers of one request do not agree (None: they do)."""
        m, store, problem = offers[0].manifest, self.receiver.store, None
        for r, o in enumerate(offers):
            if not isinstance(o, Offer):
                problem = f"rank {r} sent {type(o).__name__}, expected an offer"
            elif o.rank != r or o.manifest != m:
                problem = f"rank {r}'s offer does not match rank 0's manifest"
            elif o.nbytes != part_nbytes(store, _part_of(m, r).num_pages):
                problem = (f"rank {r} offers {o.nbytes} bytes, its part has "
                           f"{_part_of(m, r).num_pages} pages")
            elif o.pipeline != offers[0].pipeline:
                problem = f"rank {r} pipelines by {o.pipeline!r}, rank 0 by {offers[0].pipeline!r}"
        return problem

    def _reserve(self, m: TransferManifest, problem: str | None) -> dict[int, int]:
        """Reserve ``m``'s slots (waiting for quarantined slots to come back when the pool is
        full), or refuse it: every rank hears why, then :class:`TransferRefused`."""
        rx = self.receiver
        while problem is None:
            try:
                return rx.reserve(m)
            except PoolExhausted as exc:
                problem = str(exc)
                if rx.quarantined() and self._await_quarantine():
                    problem = None  # slots came back: try again
            except TransferError as exc:
                problem = str(exc)
        self._tell_all(Grant(m.request, None, problem), best_effort=True)
        raise TransferRefused(f"request {m.request!r} refused: {problem}")

    def _grant(self, m: TransferManifest, offers: list[Offer], slots: dict[int, int]) -> _Arrival:
        """Send every rank its destination slots under a new epoch."""
        epoch = self.receiver.next_epoch()
        for r in range(self.cp_size):
            part = _part_of(m, r)
            self.link.channel.send(r, Grant(m.request, [slots[p] for p in part.logical_pages()],
                                            epoch=epoch))
        n_layers = self.receiver.store.num_layers
        groups = ([range(k, k + 1) for k in range(n_layers)] if offers[0].pipeline == "layer"
                  else [range(n_layers)])
        todo = [] if self.features.one_sided else [(g, part) for g in groups for part in m.parts]
        return _Arrival(m, offers, epoch, todo, [0] * self.cp_size)

    def _arrive(self, run: _Arrival) -> None:
        """Two-sided: receive every part and layer group, in the order every sender sends
        (layer group, then rank); then every rank's :class:`Done` (it writes nothing more), its
        bytes checked against its offer. One-sided: the Done says the bytes are in place."""
        rx, m = self.receiver, run.manifest
        while run.todo:
            g, part = run.todo[0]
            run.current = part.rank
            run.got[part.rank] += self.link.recv_part(part, rx, layers=g, epoch=run.epoch)
            note_progress()  # the senders' waits are bounded by silence (their beacons)
            run.todo.pop(0)
        for r in range(self.cp_size):
            run.current = r
            run.done[r] = d = self._done(r, run.epoch, m.request)
            if d.error is not None:
                raise TransferError(f"rank {r}'s writes failed: {d.error}")
            part = _part_of(m, r)
            if self.features.one_sided:
                run.got[r] = d.nbytes
                if part.runs:
                    # a link that writes in the receiver's layout leaves nothing to re-lay
                    rx.mark_written(part, rx.store.layout if self.features.writes_receiver_layout
                                    else m.layout)
            if run.got[r] != run.offers[r].nbytes:
                raise TransferError(f"rank {r}: {run.got[r]} bytes arrived, {run.offers[r].nbytes} "
                                    f"offered")

    def _give_up(self, run: _Arrival, exc: Exception) -> NoReturn:
        """A part failed: drop the reservation (one-sided: into quarantine until every sender
        without its Done is done), fence the grant, drain a two-sided link, tell every rank."""
        m = run.manifest
        # one-sided: a sender without its Done may still write into the slots
        hold = ({p.rank for p in m.parts if p.rank not in run.done} if self.features.one_sided
                else set())
        self.receiver.abort(m, hold=hold, epoch=run.epoch)
        if self.features.fencing is not None:
            with contextlib.suppress(Exception):
                self.features.fencing.fence(run.epoch)
        if run.todo and self.features.draining is not None:  # two-sided: drain what is still sent
            with contextlib.suppress(Exception):
                self.features.draining.abandon(run.todo[1:], run.epoch)
        why = (f"transfer of {m.request!r} failed receiving rank {run.current}'s part: "
               f"{type(exc).__name__}: {exc}; nothing published")
        self._tell_all(Ack(m.request, False, why), best_effort=True)
        raise TransferError(why) from exc

    def _publish(self, run: _Arrival, t0: float) -> Received:
        """Check (counts; checksums under debug) and publish, then tell every rank."""
        rx, m, offers, done = self.receiver, run.manifest, run.offers, run.done
        sums = None
        if rx.debug:
            src = {o.rank: o.checksums for o in offers} if run.pipeline == "request" else \
                {r: d.checksums for r, d in done.items()}
            sums = {r: v for r, v in src.items() if v is not None}
        ok = rx.complete(m, sums)
        now = time.time()
        self._tell_all(Ack(m.request, ok, rx.last_error, now), best_effort=not ok)
        if not ok:
            raise TransferError(rx.last_error or f"request {m.request!r} not published")
        meta = {**offers[0].meta, **done[0].meta} if done else dict(offers[0].meta)
        return Received(m, run.got, sum(len(p.runs) for p in m.parts), time.perf_counter() - t0,
                        meta, run.pipeline, now)

    def close(self) -> None:
        """Tear the link down: no sender can write any more, so quarantined slots come back."""
        with contextlib.suppress(Exception):
            self.link.close()
        self.receiver.release_quarantine()
