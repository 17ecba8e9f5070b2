"""The transport interface of KV transfer plugins (prefill CP ranks -> one decode rank).

A transfer plugin's ``TransferSpec.load()`` returns a :class:`Transport`. Every process of a
transfer (C prefill ranks and one decode rank, the *endpoints* 0..C-1 and C) calls
:meth:`Transport.connect` with its :class:`LinkSpec`; the returned :class:`Link` carries

* a :class:`SideChannel`: small picklable messages between endpoints (manifests, reserved
  slots, checksums, acknowledgements). Over ``torch.distributed`` object point-to-point for the
  NCCL plugin (:class:`DistSideChannel`), over any TCP key-value store or socket otherwise
  (:class:`StoreSideChannel` runs on a ``torch.distributed.TCPStore`` without a process group);
* the data plane: :meth:`Link.send_part` on a prefill rank moves the bytes of the pages it owns
  for one request; :meth:`Link.recv_part` on the decode rank returns once those bytes are in the
  decode pool's reserved slots (it places them itself, or marks one-sided writes arrived).

The core drives the protocol (:mod:`cpkv.disagg.flow`): offers, reservation, grants, data,
publish, acknowledgements. A plugin only connects, moves bytes and carries messages. See
docs/transfer.md.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from cpkv.comm import current_wait, last_progress
from cpkv.settings import PluginTable

from .buffers import PoolBuffers
from .errors import TransferError
from .plan import RankTransfer, TransferManifest

if TYPE_CHECKING:
    import torch

__all__ = [
    "WAIT_SLICE_S",
    "Ack",
    "DistSideChannel",
    "Done",
    "DrainingLink",
    "FencingChannel",
    "Grant",
    "Link",
    "LinkFeatures",
    "LinkSpec",
    "Offer",
    "PartSink",
    "SideChannel",
    "SilenceClock",
    "StoreSideChannel",
    "TransferTimeout",
    "Transport",
    "link_features",
    "store_side_channel",
]


# ---- what a plugin implements ---------------------------------------------------------------

@dataclass(frozen=True)
class LinkSpec:
    """What one endpoint passes to :meth:`Transport.connect`.

    Attributes:
        endpoint: this process: 0..C-1 = prefill CP rank, ``cp_size`` = the decode rank.
        cp_size: C, the number of prefill ranks.
        buffers: this endpoint's KV buffers (:class:`~cpkv.disagg.buffers.PoolBuffers`: per
            layer a contiguous uint8 ``[pages, ps, latent + index bytes]`` tensor, what a
            one-sided transport registers, and its latent / index-K column views): the prefill
            rank's shard, or the decode rank's one-rank full-layout pool. Never the pool.
        timeout_s: bound on the silence of every wait of the transfer (``transfer.timeout_s``:
            a wait fails when no other endpoint made progress for this long).
        debug: the debug switch (checksums are computed and compared).
        world_ranks: for transports over ``torch.distributed``: the global rank of each endpoint
            (default ``range(C + 1)``). Others ignore it.
        options: the plugin's own settings table (``[transfer.<plugin>]``), which the plugin
            validates with its own model (``options.parse(Model)``); may be empty.
        store: a key-value store for the side channel (e.g. a ``torch.distributed.TCPStore``
            with ``set`` / ``get`` / ``wait`` / ``check``); None: the transport makes one
            (:func:`store_side_channel`).
    """

    endpoint: int
    cp_size: int
    buffers: PoolBuffers
    timeout_s: float = 30.0
    debug: bool = False
    world_ranks: tuple[int, ...] | None = None
    options: PluginTable = field(default_factory=PluginTable)
    store: object | None = None

    @property
    def decode_endpoint(self) -> int:
        return self.cp_size

    @property
    def is_decode(self) -> bool:
        return self.endpoint == self.cp_size

    def world_rank(self, endpoint: int) -> int:
        return self.world_ranks[endpoint] if self.world_ranks is not None else endpoint


@runtime_checkable
class SideChannel(Protocol):
    """Ordered, reliable, picklable messages between endpoints (per sender -> receiver pair).

    ``recv`` blocks until the next message from ``peer`` arrives, bounded by ``timeout_s``
    (raises on timeout or when the peer is gone). ``send`` may be called from two threads of an
    endpoint (the protocol's and its sender worker's).
    """

    #: the bound of one ``recv``, seconds
    timeout_s: float

    def send(self, peer: int, msg: Any) -> None: ...

    def recv(self, peer: int) -> Any: ...


@runtime_checkable
class FencingChannel(SideChannel, Protocol):
    """Optional capability of a side channel: it carries the decode's *fences*. The decode
    fences a grant it gave up; a one-sided sender checks its grant's fence before each batch of
    writes and writes nothing more once it is set."""

    def fence(self, epoch: int) -> None:
        """Decode: grant ``epoch`` is given up."""
        ...

    def fenced(self, epoch: int) -> bool:
        """Prefill: has the decode given grant ``epoch`` up?"""
        ...


class PartSink(Protocol):
    """Where a two-sided link puts the bytes of a part it received: the one method of the decode
    side (:class:`~cpkv.disagg.receiver.DecodeReceiver`) a transport calls."""

    def place_packed(self, part: RankTransfer, buf: torch.Tensor, *,
                     layers: range | None = None) -> None:
        """Copy ``buf`` (uint8, 1-D: for each layer of ``layers``, default every layer, the
        part's latent bytes then its index-K bytes, page after page; :func:`cpkv.disagg.pack_part`)
        into the part's reserved slots.

        Raises:
            TransferError: ``buf`` is not uint8 1-D of exactly the part's bytes for ``layers``.
        """
        ...


@runtime_checkable
class Link(Protocol):
    """One endpoint's connection, from :meth:`Transport.connect`.

    ``one_sided``: True when :meth:`send_part` writes straight into the decode pool's reserved
    slots (the decode side never touches the bytes). The core then keeps the slots of a failed
    request in quarantine until every sender of it is known done (docs/transfer.md, "Late
    writes"); a two-sided link places the bytes itself, so a late send can never reach the pool.
    ``writes_receiver_layout``: a one-sided link writes the pages in the decode pool's page
    layout (the senders re-lay them out), so the decode leaves them as they land; False: they
    land in the senders' layout and the decode re-lays them out.

    Optional capabilities are separate protocols (:class:`FencingChannel` for ``channel``,
    :class:`DrainingLink`), resolved once when the core takes the link (:func:`link_features`).
    """

    channel: SideChannel
    one_sided: bool
    writes_receiver_layout: bool

    def send_part(self, part: RankTransfer, dst_slots: Sequence[int], *,
                  layers: range | None = None, epoch: int = 0,
                  fenced: Callable[[], bool] | None = None) -> int:
        """Prefill endpoint: move the bytes of ``part`` (latent and index-K of ``layers``, default
        every layer, of its pages, read from this endpoint's buffers at ``run.src_slot``...) to
        the decode endpoint, where page ``part.logical_pages()[i]`` goes to decode slot
        ``dst_slots[i]``. ``epoch`` is the decode's grant (a two-sided link tags its messages with
        it, so a late message is never taken for a later request's). ``fenced``, when given, is
        checked before each batch of writes: once it says True nothing more is written
        (:class:`~cpkv.disagg.errors.TransferFenced`). Coalesced runs move as one entry per layer
        where the transport has entries; batches stay within its limits (rule 27). Returns the
        bytes moved: exactly ``part.num_pages * fmt.page_bytes * len(layers)``. Raises
        ``TransferError`` on any failure, and only once none of its writes can still land (a
        failed engine is torn down first)."""
        ...

    def recv_part(self, part: RankTransfer, sink: PartSink, *,
                  layers: range | None = None, epoch: int = 0) -> int:
        """Decode endpoint, two-sided links: return once the bytes of ``part``'s ``layers`` are
        placed (``sink.place_packed``), bounded by the link's timeout. Returns the bytes
        received. Raises on failure or timeout (a receive still pending keeps its own staging
        buffer: late bytes land there, never in the pool). One-sided links: the bytes are already
        in place when the sender's :class:`Done` arrived; returns 0."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DrainingLink(Link, Protocol):
    """Optional capability of a two-sided link: drain what the senders of a given-up grant still
    send, so a late message is never taken for a later request's."""

    def abandon(self, rest: Sequence[tuple[range, RankTransfer]], epoch: int) -> None:
        """The decode gave grant ``epoch`` up before receiving ``rest`` ((layers, part) in the
        order the senders send them)."""
        ...


@dataclass(frozen=True)
class LinkFeatures:
    """A link's capabilities, resolved once (:func:`link_features`) when the core takes it.

    Attributes:
        one_sided: see :class:`Link`.
        writes_receiver_layout: see :class:`Link` (False for a two-sided link).
        fencing: the link's channel when it carries fences, else None.
        draining: the link when it drains given-up grants, else None.
    """

    one_sided: bool
    writes_receiver_layout: bool
    fencing: FencingChannel | None
    draining: DrainingLink | None


def link_features(link: Link) -> LinkFeatures:
    """What ``link`` can do beyond :class:`Link`.

    Raises:
        TypeError: ``link`` is not a :class:`Link` (a missing attribute or method).
    """
    if not isinstance(link, Link):
        raise TypeError(f"{type(link).__name__} is not a cpkv.disagg.Link (it needs channel, "
                        f"one_sided, writes_receiver_layout, send_part, recv_part and close)")
    one_sided = bool(link.one_sided)
    return LinkFeatures(one_sided=one_sided,
                        writes_receiver_layout=one_sided and bool(link.writes_receiver_layout),
                        fencing=link.channel if isinstance(link.channel, FencingChannel) else None,
                        draining=link if isinstance(link, DrainingLink) else None)


@runtime_checkable
class Transport(Protocol):
    """What a transfer plugin's ``load()`` returns."""

    name: str

    def connect(self, spec: LinkSpec) -> Link:
        """Join the transfer: a collective over all C + 1 endpoints (every endpoint calls it,
        once, after its pool exists). A one-sided transport exchanges the decode pool's buffer
        addresses here. A plugin with settings validates ``spec.options`` first (before any
        collective: every endpoint has the same settings, so all fail alike)."""
        ...


# ---- the core's protocol messages ------------------------------------------------------------

@dataclass(frozen=True)
class Offer:
    """Prefill endpoint -> decode: "here is my part of this request"."""

    rank: int
    manifest: TransferManifest
    nbytes: int  # bytes this rank will move (its pages x page bytes x layers)
    checksums: list[int] | None = None  # debug: per page of its part, in logical order
    meta: Mapping[str, Any] = field(default_factory=dict)  # e.g. the first generated token
    #: "request": the whole part in one send after the prefill; "layer": one send per layer, as
    #: the layers are written (checksums then come with the :class:`Done`)
    pipeline: str = "request"


@dataclass(frozen=True)
class Grant:
    """Decode -> each prefill endpoint: the reserved destination slots of its part (in the part's
    logical page order), or why the request was refused (nothing reserved then)."""

    request: str
    dst_slots: list[int] | None
    error: str | None = None
    #: the decode's number for this reservation: a sender's :class:`Done` names it, and the
    #: decode fences it (``SideChannel.fence``) when it gives the request up
    epoch: int = 0


@dataclass(frozen=True)
class Done:
    """Prefill endpoint -> decode once none of its writes of a granted request can still land:
    every send returned (``error`` None: ``nbytes`` moved), or its sends failed or were fenced
    (``error`` says why; some bytes may have landed). Every granted endpoint sends exactly one
    per grant, late or not: the decode releases a failed request's quarantined slots on it."""

    request: str
    rank: int
    epoch: int
    nbytes: int
    error: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    checksums: list[int] | None = None  # debug, layer pipeline: per page of its part


@dataclass(frozen=True)
class Ack:
    """Decode -> each prefill endpoint: the request was published, or not and why."""

    request: str
    published: bool
    error: str | None = None
    #: the decode's wall clock (``time.time()``) when it published (prefill ranks on the same
    #: host measure ``ready_seconds`` with it)
    published_at: float = 0.0


# ---- side channels the core provides ---------------------------------------------------------

class DistSideChannel:
    """Messages over ``torch.distributed`` object point-to-point (``send_object_list``) in
    ``group`` (a Gloo group: the messages are tiny and stay on the host)."""

    def __init__(self, spec: LinkSpec, group: Any = None) -> None:
        self.spec, self.group = spec, group
        self.timeout_s = spec.timeout_s

    def send(self, peer: int, msg: Any) -> None:
        import torch.distributed as dist

        dist.send_object_list([msg], dst=self.spec.world_rank(peer), group=self.group)

    def recv(self, peer: int) -> Any:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.recv_object_list(box, src=self.spec.world_rank(peer), group=self.group)
        return box[0]


#: a wait on the side-channel store runs in slices this long; between them the endpoints'
#: progress beacons are read (the bound is on silence, not on wall time)
WAIT_SLICE_S = 0.5

#: the longest pause between two polls of a message key in a quiet wait (seconds): a message's
#: latency after a long wait, at one store round trip per pause
POLL_PAUSE_MAX_S = 0.01


class TransferTimeout(TransferError):
    """A wait of the transfer saw no progress on any other endpoint for ``timeout_s``
    (``transfer.timeout_s``; the message names the setting and what was awaited)."""


class StoreSideChannel:
    """Messages over a key-value store (``torch.distributed.TCPStore`` or any object with
    ``set(key, bytes)``, ``get(key)``, ``wait([key], timedelta)``, ``delete_key(key)``): a plain
    TCP side channel that needs no process group. Keys are ``{prefix}/{src}->{dst}/{seq}``.

    Sends (and :meth:`fenced`) go through a second connection when the store can ``clone()``:
    one thread may wait in :meth:`recv` while another sends (a store client serves one call at
    a time).

    Bound: with ``endpoints`` (C + 1) every endpoint publishes its progress
    (:func:`cpkv.comm.note_progress`: the prefill notes it per layer and row chunk) under
    ``{prefix}/progress/{endpoint}`` from a beacon thread (on a third connection), and a wait in
    :meth:`recv` fails only after ``timeout_s`` in which no other endpoint made progress: the
    decode may wait for a request's first message through a prefill of any length, and a hung
    sender still fails it within ``timeout_s``. Without ``endpoints`` (or a store that cannot
    ``clone``) a wait is bounded by ``timeout_s`` of wall time.
    """

    def __init__(self, store: Any, endpoint: int, timeout_s: float, prefix: str = "cpkv-xfer",
                 endpoints: int = 0) -> None:
        self.store, self.endpoint, self.timeout_s, self.prefix = store, endpoint, timeout_s, prefix
        self._sent: dict[int, int] = {}
        self._got: dict[int, int] = {}
        self._lock = threading.Lock()  # the protocol's thread and the sender worker both send
        clone = getattr(store, "clone", None)
        self._out = clone() if callable(clone) else store
        self.endpoints = endpoints if callable(clone) else 0
        self._stop = threading.Event()
        if self.endpoints and callable(clone):
            threading.Thread(target=self._beacon, args=(clone(),), daemon=True,
                             name="cpkv-xfer-beacon").start()

    def _key(self, src: int, dst: int, seq: int) -> str:
        return f"{self.prefix}/{src}->{dst}/{seq}"

    def _beacon(self, store: Any) -> None:
        """Publish this endpoint's progress count, and the collective it waits in, whenever
        either changed (every slice)."""
        told = ""
        key = f"{self.prefix}/progress/{self.endpoint}"
        while not self._stop.is_set():
            wait = current_wait()
            now = f"{last_progress().seq}|{wait[1] if wait is not None else ''}"
            if now != told:
                try:
                    store.set(key, now.encode())
                except Exception:  # the store's host is gone: the waits say so
                    return
                told = now
            self._stop.wait(WAIT_SLICE_S)

    def beacons(self) -> dict[int, tuple[int, str]]:
        """The other endpoints' published (progress count, collective waited in or "");
        endpoints that published nothing yet are missing; {} without beacons."""
        out: dict[int, tuple[int, str]] = {}
        for e in range(self.endpoints):
            key = f"{self.prefix}/progress/{e}"
            if e == self.endpoint:
                continue
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    seq, _, what = self.store.get(key).decode().partition("|")
                    out[e] = (int(seq), what)
        return out

    def progress(self) -> tuple[int, ...]:
        """The other endpoints' published progress counts (-1: none yet); () without beacons.
        A change between two calls means some endpoint made progress."""
        got = self.beacons()
        return tuple(got[e][0] if e in got else -1 for e in range(self.endpoints)
                     if e != self.endpoint)

    def silence(self) -> str:
        """For messages: what each other endpoint does, e.g. ``"rank 0 waits in
        all_gather_rows; rank 1 waits in no collective"`` (the one that hung)."""
        got = self.beacons()
        return "; ".join(f"{self._name(e)} " + (f"waits in {got[e][1]}" if got[e][1]
                                                else "waits in no collective")
                         for e in sorted(got))

    def _name(self, endpoint: int) -> str:
        """How messages call an endpoint: prefill ``rank r``, or the decode rank (the last)."""
        return "the decode rank" if endpoint == self.endpoints - 1 else f"rank {endpoint}"

    def close(self) -> None:
        """Stop the progress beacon."""
        self._stop.set()

    def send(self, peer: int, msg: Any) -> None:
        data = pickle.dumps(msg)
        with self._lock:
            seq = self._sent.get(peer, 0)
            self._sent[peer] = seq + 1
            self._out.set(self._key(self.endpoint, peer, seq), data)

    def fence(self, epoch: int) -> None:
        """Decode: grant ``epoch`` is given up; a sender that checks :meth:`fenced` before each
        batch writes nothing more for it."""
        with self._lock:
            self._out.set(f"{self.prefix}/fence/{epoch}", b"1")

    def fenced(self, epoch: int) -> bool:
        """Prefill: has the decode given grant ``epoch`` up? (one store round trip)"""
        with self._lock:
            return bool(self._out.check([f"{self.prefix}/fence/{epoch}"]))

    def recv(self, peer: int) -> Any:
        """The next message from ``peer``.

        Raises:
            TransferTimeout: none came, and no other endpoint made progress, for ``timeout_s``.
        """
        seq = self._got.get(peer, 0)
        key = self._key(peer, self.endpoint, seq)
        if not self.endpoints:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        else:
            self._wait_quietly(key, peer)
        msg = pickle.loads(self.store.get(key))
        self._got[peer] = seq + 1
        with contextlib.suppress(Exception):  # stores without delete keep the key; harmless
            self.store.delete_key(key)
        return msg

    def _wait_quietly(self, key: str, peer: int) -> None:
        clock = SilenceClock(self)
        while True:
            left = self.timeout_s - clock.quiet_s()
            if left <= 0:
                raise TransferTimeout(
                    f"{self._name(self.endpoint)} waited for message {key.rsplit('/', 1)[-1]} "
                    f"from {self._name(peer)}, and no endpoint made progress, for "
                    f"{self.timeout_s:g} s "
                    f"(transfer.timeout_s bounds this silence: raise it if one step of the "
                    f"prefill, e.g. a layer's row chunk, takes longer): {self.silence()}")
            if self._arrives(key, min(WAIT_SLICE_S, left)):
                return

    def _arrives(self, key: str, seconds: float) -> bool:
        """Whether ``key`` is set within ``seconds``: polled with ``check`` (a pause growing
        from 0.5 ms to :data:`POLL_PAUSE_MAX_S`), not a timed ``wait``, each of whose timeouts
        makes c10d log two warnings on stderr (a decode rank waiting out a long prefill printed
        dozens)."""
        end = time.monotonic() + seconds
        pause = 0.0005
        while not self.store.check([key]):
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_PAUSE_MAX_S)
        return True


class SilenceClock:
    """Seconds since another endpoint of ``channel`` last made progress (as its beacon shows;
    wall time since the clock started where the channel has none)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.seen = self._read()
        self.since = time.monotonic()

    def _read(self) -> tuple[int, ...]:
        progress = getattr(self.channel, "progress", None)
        return progress() if callable(progress) else ()

    def quiet_s(self) -> float:
        """Seconds of silence so far (reads the beacons)."""
        now = self._read()
        if now != self.seen:
            self.seen, self.since = now, time.monotonic()
        return time.monotonic() - self.since


def store_side_channel(spec: LinkSpec, hostname: str, prefix: str) -> tuple[StoreSideChannel, Any]:
    """A :class:`StoreSideChannel` on a ``TCPStore`` that the decode endpoint hosts on
    ``hostname`` (a timed-out wait leaves it usable, unlike a Gloo pair, which its first timeout
    closes: a stalled sender must not break the link for the next request), or on
    ``spec.store``. The store's port reaches the prefill endpoints over a Gloo group
    of the endpoints' ``torch.distributed`` world (``new_group``: collective over the world).
    Every endpoint publishes its progress; the decode waits for a message until no other endpoint
    made progress for ``timeout_s``, a prefill endpoint for (C + 1) x ``timeout_s`` (it hears the
    decode's verdict on a stalled peer instead of timing out first). Returns (channel, the store
    when made here).

    Raises:
        RuntimeError: no store given and no initialized ``torch.distributed`` world.
        TransferError: the decode endpoint could not host the store.
    """
    wait_s = spec.timeout_s if spec.is_decode else (spec.cp_size + 1) * spec.timeout_s
    n = spec.cp_size + 1
    if spec.store is not None:
        return StoreSideChannel(spec.store, spec.endpoint, wait_s, prefix, n), None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the transfer needs a side channel: an initialized torch.distributed "
                           "world holding the C prefill ranks and the decode rank, or "
                           "LinkSpec.store (e.g. a torch.distributed.TCPStore)")
    timeout = timedelta(seconds=spec.timeout_s)
    ranks = [spec.world_rank(e) for e in range(spec.cp_size + 1)]
    group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    store = None
    box: list[Any] = [None]
    if spec.is_decode:
        try:
            store = dist.TCPStore(hostname, 0, None, True, timeout, wait_for_workers=False)
            box[0] = store.port
        except Exception as exc:  # the prefill endpoints must hear of it, not hang
            box[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(box, src=spec.world_rank(spec.decode_endpoint), group=group)
    if not isinstance(box[0], int):
        raise TransferError(f"connect: the decode endpoint's side-channel store on {hostname} "
                            f"failed: {box[0]}")
    if store is None:
        store = dist.TCPStore(hostname, box[0], None, False, timeout)
    return StoreSideChannel(store, spec.endpoint, wait_s, prefix, n), store
