"""The transfer protocol, driven by the core over any :class:`~cpkv.disagg.transport.Link`.

Per request (one :class:`TransferManifest`, identical on every prefill rank):

1. every prefill rank r -> decode: :class:`Offer` (manifest, its byte count, debug checksums);
2. decode: checks the offers agree, reserves slots (all or nothing) -> every rank:
   :class:`Grant` (its destination slots, or the refusal: then every side raises, nothing moved);
3. every rank with pages: ``link.send_part``; decode: ``link.recv_part`` per part;
4. decode: ``DecodeReceiver.complete`` (counts; checksums under debug) -> every rank:
   :class:`Ack`. A failure at any step aborts the reservation: nothing is published.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cpkv.kv import PoolExhausted, RequestPages, ShardedKVPool

from .plan import RankTransfer, TransferManifest, manifest_for
from .receiver import DecodeReceiver, TransferError, page_checksums, part_nbytes
from .transport import Ack, Grant, Link, Offer

__all__ = ["DecodeTransfer", "PrefillTransfer", "Received", "Sent"]


@dataclass(frozen=True)
class Sent:
    """One request's transfer as a prefill rank saw it."""

    request: str
    nbytes: int
    entries: int  # coalesced page runs sent (each one entry per layer and buffer)
    seconds: float
    #: what was sent (identical on every prefill rank)
    manifest: TransferManifest


@dataclass(frozen=True)
class Received:
    """One published request on the decode rank."""

    manifest: TransferManifest
    bytes_per_rank: list[int]
    entries: int
    seconds: float
    meta: Mapping[str, Any] = field(default_factory=dict)


def _part_of(manifest: TransferManifest, rank: int) -> RankTransfer:
    return next((p for p in manifest.parts if p.rank == rank),
                RankTransfer(request=manifest.request, rank=rank, runs=()))


class PrefillTransfer:
    """The sending side on prefill CP rank ``rank`` (endpoint ``rank`` of ``link``).

    :meth:`send_request` sends a request's pages from the pool's page table and remembers how
    many pages of it were sent, so the chunks of a chunked prefill continue each other;
    :meth:`send` sends a manifest built elsewhere.
    """

    def __init__(self, link: Link, pool: ShardedKVPool, rank: int, cp_size: int, *,
                 debug: bool = False) -> None:
        self.link, self.pool, self.rank, self.cp_size, self.debug = link, pool, rank, cp_size, debug
        #: request -> logical pages already sent (by earlier chunks)
        self.sent_pages: dict[str, int] = {}

    def send_request(self, request: Hashable, pages: RequestPages, *, final: bool = True,
                     meta: Mapping[str, Any] | None = None) -> Sent:
        """Send the pages of ``request`` (page table ``pages``) not sent before: after a non-final
        chunk only its whole pages (rule 26), after the final one the rest, tail page included.
        Every prefill rank calls it with the same arguments; returns once decode published.

        Raises:
            TransferError: the decode rank refused or did not publish the request (nothing of
                this call counts as sent then).
        """
        rid = str(request)
        m = manifest_for(rid, pages, self.pool.fmt.page_size, self.cp_size, final=final,
                         already_sent=self.sent_pages.get(rid, 0))
        done = self.send(m, meta)
        if final:
            self.sent_pages.pop(rid, None)
        else:
            self.sent_pages[rid] = m.num_pages
        return done

    def send(self, manifest: TransferManifest, meta: Mapping[str, Any] | None = None) -> Sent:
        """Send this rank's part of ``manifest`` (every prefill rank calls it with the same
        manifest). Returns after the decode rank published the request.

        Raises:
            TransferError: the decode rank refused or did not publish the request.
        """
        t0 = time.perf_counter()
        if self.pool.loads_pending:  # pages a cache hit brought back from the host, in place first
            self.pool.flush_loads()
        part = _part_of(manifest, self.rank)
        src = [r.src_slot + i for r in part.runs for i in range(r.num_pages)]
        sums = page_checksums(self.pool, src) if self.debug else None
        decode = self.cp_size
        self.link.channel.send(decode, Offer(self.rank, manifest, part_nbytes(self.pool, part.num_pages),
                                             sums, dict(meta or {})))
        grant: Grant = self.link.channel.recv(decode)
        if grant.error is not None or grant.dst_slots is None:
            raise TransferError(f"decode refused request {manifest.request!r}: {grant.error}")
        sent = self.link.send_part(part, grant.dst_slots) if part.runs else 0
        ack: Ack = self.link.channel.recv(decode)
        if not ack.published:
            raise TransferError(f"decode did not publish request {manifest.request!r}: {ack.error}")
        return Sent(manifest.request, sent, len(part.runs), time.perf_counter() - t0, manifest)


class DecodeTransfer:
    """The receiving side on the decode rank (endpoint C of ``link``)."""

    def __init__(self, link: Link, receiver: DecodeReceiver, cp_size: int) -> None:
        self.link, self.receiver, self.cp_size = link, receiver, cp_size

    def _tell_all(self, msg: Any, best_effort: bool = False) -> None:
        for r in range(self.cp_size):
            try:
                self.link.channel.send(r, msg)
            except Exception:
                if not best_effort:
                    raise

    def receive(self) -> Received:
        """Receive, assemble and publish the next request.

        Raises:
            TransferError: refused (pool exhausted, inconsistent offers), a transport failure, or
                the parts did not check out; nothing was published and the reservation is gone.
        """
        rx, c = self.receiver, self.cp_size
        offers: list[Offer] = [self.link.channel.recv(r) for r in range(c)]
        t0 = time.perf_counter()
        m = offers[0].manifest
        problem = None
        for r, o in enumerate(offers):
            if o.rank != r or o.manifest != m:
                problem = f"rank {r}'s offer does not match rank 0's manifest"
            elif o.nbytes != part_nbytes(rx.pool, _part_of(m, r).num_pages):
                problem = (f"rank {r} offers {o.nbytes} bytes, its part has "
                           f"{_part_of(m, r).num_pages} pages")
        slots: dict[int, int] = {}
        if problem is None:
            try:
                slots = rx.reserve(m)
            except (PoolExhausted, TransferError) as exc:
                problem = str(exc)
        if problem is not None:
            self._tell_all(Grant(m.request, None, problem), best_effort=True)
            raise TransferError(f"request {m.request!r} refused: {problem}")
        for r in range(c):
            part = _part_of(m, r)
            self.link.channel.send(r, Grant(m.request, [slots[p] for p in part.logical_pages()]))
        got = [0] * c
        current = -1
        try:
            for part in m.parts:
                current = part.rank
                got[part.rank] = self.link.recv_part(part, rx)
                if got[part.rank] != offers[part.rank].nbytes:
                    raise TransferError(f"rank {part.rank}: {got[part.rank]} bytes arrived, "
                                        f"{offers[part.rank].nbytes} offered")
        except Exception as exc:
            rx.abort(m)
            why = (f"transfer of {m.request!r} failed receiving rank {current}'s part: "
                   f"{type(exc).__name__}: {exc}; nothing published")
            self._tell_all(Ack(m.request, False, why), best_effort=True)
            raise TransferError(why) from exc
        sums = {o.rank: o.checksums for o in offers if o.checksums is not None} if rx.debug else None
        ok = rx.complete(m, sums)
        self._tell_all(Ack(m.request, ok, rx.last_error), best_effort=not ok)
        if not ok:
            raise TransferError(rx.last_error or f"request {m.request!r} not published")
        return Received(m, got, sum(len(p.runs) for p in m.parts), time.perf_counter() - t0,
                        offers[0].meta)
