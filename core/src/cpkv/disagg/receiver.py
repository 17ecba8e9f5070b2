"""Receiver-side assembly (contract rule 25): received pages land at reserved slots of a non-CP,
full-layout decode pool; a request is published only when every rank's part arrived and checks out.

The decode pool is a :class:`~cpkv.kv.ShardedKVPool` of one rank (``CPGroup.single()``): every
page of a published request is owned by rank 0. The receiver works on the pool's two units, its
page table and its store (``pool.pages``, ``pool.store``), not the pool, and keeps its
reservations to itself: the page table changes only in :meth:`DecodeReceiver.complete`, so a
failed or partial transfer never shows up in it, and :meth:`DecodeReceiver.abort` gives the
reserved slots back.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cpkv.contracts import PageLayout, pages_nbytes
from cpkv.kv import KVStore, PageTable
from cpkv.kv.buffers import read_part, write_part

from .buffers import registered_buffers
from .errors import TransferError
from .plan import RankTransfer, TransferManifest

__all__ = ["DecodeReceiver", "pack_part", "page_checksums", "part_nbytes"]


def part_nbytes(store: KVStore, num_pages: int, layers: range | None = None) -> int:
    """Bytes of ``num_pages`` pages of every layer (or of ``layers``), latent and index-K of
    each layer's own format (none for a layer without index-K): what a part moves."""
    return pages_nbytes(store.fmts, num_pages, layers)


def _slots_tensor(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(slots), dtype=torch.int64, device=device)


def pack_part(store: KVStore, part: RankTransfer, layers: range | None = None) -> torch.Tensor:
    """The sender's pages of ``part`` as one contiguous uint8 buffer (on the store's device), in
    the packed part layout (:meth:`~cpkv.disagg.buffers.PoolBuffers.pack`)."""
    return registered_buffers(store).pack(part, layers)


def page_checksums(store: KVStore, slots: Sequence[int],
                   valid_rows: Sequence[int] | None = None) -> list[int]:
    """CRC32 of each page's bytes (latent of every layer, then index-K of every layer that has
    it), for the
    pages at physical ``slots`` of ``store``, in that order; with ``valid_rows``, only the first
    ``valid_rows[i]`` token rows of page i (the valid part of a request's tail page). Syncs the
    device: debug only."""
    if not slots:
        return []
    idx = _slots_tensor(slots, store.group.device)
    n = len(slots)
    sp = store.spec  # each part's token rows, the same bytes in every layout
    lat = torch.stack([read_part(sp, k, "latent", idx) for k in range(store.num_layers)], 2)
    # layers without index-K (GLM-5's shared layers) hold none: their index bytes are absent
    full = [k for k in range(store.num_layers) if store.fmts[k].index_k]
    ixk = torch.stack([read_part(sp, k, "index_k", idx) for k in full], 2) if full else \
        lat.new_zeros((n, lat.shape[1], 0, 0))
    if valid_rows is not None:  # [n, ps, layers, bytes]: zero the rows past each page's valid part
        keep = torch.arange(lat.shape[1], device=lat.device)[None, :] < torch.tensor(
            list(valid_rows), device=lat.device)[:, None]
        lat, ixk = lat * keep[:, :, None, None], ixk * keep[:, :, None, None]
    lat, ixk = lat.transpose(1, 2), ixk.transpose(1, 2)  # layer-major, as before
    rows = torch.cat([lat.reshape(n, -1), ixk.reshape(n, -1)], 1).cpu().numpy()
    return [zlib.crc32(rows[i].tobytes()) for i in range(n)]


@dataclass
class _Reservation:
    manifest: TransferManifest
    slots: dict[int, int]  # logical page -> decode slot
    arrived: dict[int, int] = field(default_factory=dict)  # sender rank -> pages placed
    layers: dict[int, set[int]] = field(default_factory=dict)  # sender rank -> layers placed


@dataclass
class _Quarantine:
    """Slots of a given-up request that a sender may still write (one-sided transports)."""

    request: str
    slots: list[int]
    pending: set[int]  # sender ranks not yet known done


class DecodeReceiver:
    """Assembles transferred pages into a non-CP decode pool and publishes whole requests.

    Per request (manifest): :meth:`reserve` -> :meth:`place` / :meth:`place_packed` /
    :meth:`mark_written` once per rank part -> :meth:`complete` (publish or reject); or
    :meth:`abort`. The page table is keyed by ``manifest.request``.

    Args:
        pages: the page table of a one-rank pool (``CPGroup.single()``): owner 0 holds every
            page (``pool.pages``).
        store: that pool's bytes (``pool.store``).
        debug: require per-page checksums in :meth:`complete` and compare them (contract rule 31).

    Attributes:
        last_error: why the last :meth:`complete` returned False (None after a publish).
    """

    def __init__(self, pages: PageTable, store: KVStore, *, debug: bool = False) -> None:
        if store.group.size != 1:
            raise ValueError(f"the decode pool is not CP: it needs a one-rank group, got "
                             f"{store.group.size} ranks")
        self.pages, self.store = pages, store
        self.debug = debug
        self._res: dict[str, _Reservation] = {}
        #: epoch -> slots held back from the allocator until every pending sender is done
        self._quarantine: dict[int, _Quarantine] = {}
        self._epoch = 0
        self.last_error: str | None = None

    def next_epoch(self) -> int:
        """A new grant number (never reused by this receiver: a fence names one grant)."""
        self._epoch += 1
        return self._epoch

    # ---- reservation -----------------------------------------------------------------------
    def in_flight(self) -> list[str]:
        """Requests with a reservation (not yet completed or aborted)."""
        return list(self._res)

    def reserve(self, manifest: TransferManifest) -> dict[int, int]:
        """Reserve a decode slot for every page of ``manifest``, all or nothing.

        Returns: logical page -> destination slot.

        Raises:
            PoolExhausted: not enough free pages (the pool is unchanged).
            TransferError: the request is already in flight, or the manifest does not continue
                the request's published entry (``first_page`` must equal its page count and its
                valid length ``first_page * page_size``).
        """
        rid, ps = manifest.request, self.store.fmt.page_size
        if manifest.page_size != ps:
            raise TransferError(f"request {rid!r}: manifest pages of {manifest.page_size} tokens, "
                                f"the decode pool has {ps}")
        if rid in self._res:
            raise TransferError(f"request {rid!r} already has a transfer in flight")
        rp = self.pages.requests.get(rid)
        have_pages = 0 if rp is None else len(rp.slots)
        have_len = 0 if rp is None else rp.valid_len
        if manifest.first_page != have_pages or have_len != manifest.first_page * ps:
            raise TransferError(f"request {rid!r}: the manifest starts at page {manifest.first_page}"
                                f", the decode pool holds {have_pages} pages / {have_len} tokens")
        pages = list(range(manifest.first_page, manifest.num_pages))
        got = self.pages.allocate_pages(0, len(pages), what=f"transfer of {rid!r}")
        slots = dict(zip(pages, got, strict=True))
        self._res[rid] = _Reservation(manifest, slots)
        return dict(slots)

    def _take(self, part: RankTransfer) -> _Reservation:
        res = self._res.get(part.request)
        if res is None:
            raise TransferError(f"request {part.request!r}: no reservation (not reserved, or "
                                f"already completed or aborted)")
        want = next((p for p in res.manifest.parts if p.rank == part.rank), None)
        if want is None or want.runs != part.runs:
            raise TransferError(f"request {part.request!r}: rank {part.rank}'s part does not match "
                                f"the manifest")
        if part.rank in res.arrived:
            raise TransferError(f"request {part.request!r}: rank {part.rank}'s part arrived twice")
        return res

    def _arrive(self, res: _Reservation, part: RankTransfer, layers: range) -> None:
        """Count ``layers`` of ``part`` placed; the part has arrived once every layer has."""
        got = res.layers.setdefault(part.rank, set())
        again = got.intersection(layers)
        if again:
            raise TransferError(f"request {part.request!r}: rank {part.rank}'s layers "
                                f"{sorted(again)[:8]} arrived twice")
        got.update(layers)
        if len(got) == self.store.num_layers:
            res.arrived[part.rank] = part.num_pages

    def dst_slots(self, part: RankTransfer) -> list[int]:
        """Reserved decode slots of ``part``'s pages, in the part's logical order."""
        res = self._res[part.request]
        return [res.slots[p] for p in part.logical_pages()]

    # ---- arrival ---------------------------------------------------------------------------
    def place(self, part: RankTransfer, latent: Sequence[torch.Tensor],
              index_k: Sequence[torch.Tensor], *, layers: range | None = None) -> None:
        """Write ``part``'s received pages of ``layers`` (default: every layer) at their reserved
        slots; the part has arrived once every layer has.

        ``latent[i]`` / ``index_k[i]``: uint8 ``[part.num_pages, ps, bytes]`` of layer
        ``layers[i]``, pages in the part's logical order.

        Raises:
            TransferError: unknown request or part, part (or one of these layers) already
                arrived, wrong shapes (nothing was written then).
        """
        res = self._take(part)
        store, n = self.store, part.num_pages
        layers = range(store.num_layers) if layers is None else layers
        fmt = store.fmt
        ps, lb = fmt.page_size, fmt.latent_bytes_per_token
        if len(latent) != len(layers) or len(index_k) != len(layers) or \
                (len(layers) and not 0 <= layers[0] <= layers[-1] < store.num_layers):
            raise TransferError(f"request {part.request!r} rank {part.rank}: {len(latent)}/"
                                f"{len(index_k)} layers received for layers {layers}, the pool "
                                f"has {store.num_layers}")
        for layer, a, b in zip(layers, latent, index_k, strict=True):
            ib = store.fmts[layer].index_bytes_per_token
            if tuple(a.shape) != (n, ps, lb) or tuple(b.shape) != (n, ps, ib) or \
                    a.dtype != torch.uint8 or b.dtype != torch.uint8:
                raise TransferError(f"request {part.request!r} rank {part.rank}: received pages "
                                    f"{tuple(a.shape)}/{tuple(b.shape)}, expected {(n, ps, lb)}/"
                                    f"{(n, ps, ib)} uint8")
        if set(layers) & res.layers.get(part.rank, set()):
            self._arrive(res, part, layers)  # raises: arrived twice
        idx = _slots_tensor(self.dst_slots(part), store.group.device)
        for i, layer in enumerate(layers):  # into each part's place in the pool's layout
            write_part(store.spec, layer, "latent", idx, latent[i].to(store.group.device))
            if store.fmts[layer].index_k:
                write_part(store.spec, layer, "index_k", idx, index_k[i].to(store.group.device))
        self._arrive(res, part, layers)

    def place_packed(self, part: RankTransfer, buf: torch.Tensor, *,
                     layers: range | None = None) -> None:
        """:meth:`place` from one buffer in the packed part layout (see :func:`pack_part`),
        holding ``layers`` (default: every layer)."""
        store, n = self.store, part.num_pages
        layers = range(store.num_layers) if layers is None else layers
        want = part_nbytes(store, n, layers)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != want:
            raise TransferError(f"request {part.request!r} rank {part.rank}: received "
                                f"{buf.numel()} bytes ({buf.dtype}), expected {want} for {n} pages")
        fmt = store.fmt
        ps, lb = fmt.page_size, fmt.latent_bytes_per_token
        lat, idx, off = [], [], 0
        for layer in layers:  # a layer without index-K sent its latent only
            ib = store.fmts[layer].index_bytes_per_token
            lat.append(buf[off:off + n * ps * lb].view(n, ps, lb))
            off += n * ps * lb
            idx.append(buf[off:off + n * ps * ib].view(n, ps, ib))
            off += n * ps * ib
        self.place(part, lat, idx, layers=layers)

    def mark_written(self, part: RankTransfer,
                     layout: PageLayout = PageLayout.TOKEN_MAJOR) -> None:
        """Mark ``part`` arrived when the transport wrote its bytes straight into the reserved
        slots (one-sided writes, e.g. Mooncake), as blocks in the senders' ``layout``: pages of
        another layout than the decode pool's are re-laid out in place here. Call only once the
        bytes are in place."""
        res = self._take(part)
        if layout is not self.store.layout:
            self.store.relayout(self.dst_slots(part), layout)
        res.arrived[part.rank] = part.num_pages

    # ---- publish / abort -------------------------------------------------------------------
    def _check(self, res: _Reservation, checksums: Mapping[int, Sequence[int]] | None) -> str | None:
        m = res.manifest
        for part in m.parts:
            if part.rank not in res.arrived:
                return f"rank {part.rank}'s part ({part.num_pages} pages) did not arrive"
            if res.arrived[part.rank] != part.num_pages:
                return (f"rank {part.rank}: {res.arrived[part.rank]} pages arrived, the manifest "
                        f"has {part.num_pages}")
        extra = set(res.arrived) - {p.rank for p in m.parts}
        if extra:
            return f"parts arrived from ranks {sorted(extra)} that the manifest does not list"
        if sum(res.arrived.values()) != m.num_pages - m.first_page:
            return (f"{sum(res.arrived.values())} pages arrived, the manifest covers "
                    f"{m.num_pages - m.first_page}")
        if self.debug:
            if checksums is None:
                return "debug: no checksums were sent"
            for part in m.parts:
                sent = list(checksums.get(part.rank, ()))
                got = page_checksums(self.store, self.dst_slots(part))
                if sent != got:
                    bad = [p for p, a, b in zip(part.logical_pages(), sent, got, strict=False)
                           if a != b] or part.logical_pages()
                    return (f"debug: checksum mismatch in rank {part.rank}'s pages {bad[:8]} "
                            f"({len(sent)} sent, {len(got)} placed)")
        return None

    def complete(self, manifest: TransferManifest,
                 checksums: Mapping[int, Sequence[int]] | None = None) -> bool:
        """Publish ``manifest``'s request if every rank's part arrived and checks out.

        Counts are always checked; with ``debug`` the per-page checksums the senders computed
        (``checksums[rank]``, in each part's logical page order) must equal the placed bytes'.
        Publishing creates the page table entry (owners all 0, valid length
        ``manifest.valid_len``) or extends a continued request's entry. Otherwise the
        reservation is released, nothing is published, and :attr:`last_error` says why.

        Returns: True when published.
        """
        res = self._res.get(manifest.request)
        if res is None or res.manifest != manifest:
            self.last_error = (f"request {manifest.request!r}: no reservation for this manifest")
            return False
        error = self._check(res, checksums)
        if error is not None:
            self.last_error = f"request {manifest.request!r}: {error}; nothing published"
            self.abort(manifest)
            return False
        del self._res[manifest.request]
        self.pages.extend(manifest.request, [(0, res.slots[p]) for p in
                                            range(manifest.first_page, manifest.num_pages)],
                         manifest.valid_len)
        self.last_error = None
        return True

    def abort(self, manifest: TransferManifest | str, *, hold: Iterable[int] = (),
              epoch: int = 0) -> None:
        """Give up the request's reservation (no-op when nothing is reserved). Without ``hold``
        its slots go back to the allocator. With ``hold`` (sender ranks that may still write
        into them: one-sided transports) they go to quarantine under ``epoch`` instead, and come
        back only when :meth:`sender_done` has been called for every one of those ranks (or
        :meth:`release_quarantine`): a late write can never land in memory given to another
        request."""
        rid = manifest if isinstance(manifest, str) else manifest.request
        res = self._res.pop(rid, None)
        if res is None or not res.slots:
            return
        pending = set(hold)
        if pending:
            self._quarantine[epoch] = _Quarantine(rid, list(res.slots.values()), pending)
        else:
            self.pages.release((0, s) for s in res.slots.values())

    def sender_done(self, epoch: int, rank: int) -> bool:
        """Sender ``rank`` of quarantined grant ``epoch`` writes nothing more (its :class:`Done`
        arrived, or its link is gone); the slots go back once no sender is pending. Returns
        whether ``epoch`` was quarantined and waiting for ``rank``."""
        q = self._quarantine.get(epoch)
        if q is None or rank not in q.pending:
            return False
        q.pending.discard(rank)
        if not q.pending:
            del self._quarantine[epoch]
            self.pages.release((0, s) for s in q.slots)
        return True

    def quarantined(self) -> dict[int, tuple[str, list[int], list[int]]]:
        """epoch -> (request, slots held back, sender ranks still pending)."""
        return {e: (q.request, list(q.slots), sorted(q.pending)) for e, q in self._quarantine.items()}

    def release_quarantine(self) -> None:
        """Every link to the senders is torn down (nothing can write any more): give every
        quarantined slot back."""
        for e in list(self._quarantine):
            q = self._quarantine.pop(e)
            self.pages.release((0, s) for s in q.slots)

    def free(self, rid: Hashable) -> None:
        """Release a published request (after decoding it)."""
        self.pages.free(rid)
