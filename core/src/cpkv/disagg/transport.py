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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .plan import RankTransfer, TransferManifest

if TYPE_CHECKING:
    from cpkv.kv import ShardedKVPool

    from .receiver import DecodeReceiver

__all__ = ["Ack", "DistSideChannel", "Grant", "Link", "LinkSpec", "Offer", "SideChannel",
           "StoreSideChannel", "Transport"]


# ---- what a plugin implements ---------------------------------------------------------------

@dataclass(frozen=True)
class LinkSpec:
    """What one endpoint passes to :meth:`Transport.connect`.

    Attributes:
        endpoint: this process: 0..C-1 = prefill CP rank, ``cp_size`` = the decode rank.
        cp_size: C, the number of prefill ranks.
        pool: this endpoint's pool: the prefill rank's sharded pool, or the decode rank's
            one-rank full-layout pool (its buffers ``kv[layer]`` are contiguous uint8
            ``[pages, ps, latent + index bytes]``: what a one-sided transport registers;
            ``latent[layer]`` / ``index_k[layer]`` are their column views).
        timeout_s: bound on every wait of one transfer (``transfer.timeout_s``).
        debug: the debug switch (checksums are computed and compared).
        world_ranks: for transports over ``torch.distributed``: the global rank of each endpoint
            (default ``range(C + 1)``). Others ignore it.
        options: plugin-specific settings (e.g. a hostname or protocol); may be empty.
    """

    endpoint: int
    cp_size: int
    pool: ShardedKVPool
    timeout_s: float = 30.0
    debug: bool = False
    world_ranks: tuple[int, ...] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

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

    ``recv`` blocks until the next message from ``peer`` arrives, bounded by the link's timeout
    (raises on timeout or when the peer is gone).
    """

    def send(self, peer: int, msg: Any) -> None: ...

    def recv(self, peer: int) -> Any: ...


@runtime_checkable
class Link(Protocol):
    """One endpoint's connection, from :meth:`Transport.connect`."""

    channel: SideChannel

    def send_part(self, part: RankTransfer, dst_slots: Sequence[int]) -> int:
        """Prefill endpoint: move the bytes of ``part`` (latent and index-K of every layer of its
        pages, read from this endpoint's pool at ``run.src_slot``...) to the decode endpoint,
        where page ``part.logical_pages()[i]`` goes to decode slot ``dst_slots[i]``. Coalesced
        runs move as one entry per (layer, buffer) where the transport has entries; batches stay
        within its limits (rule 27). Returns the bytes moved: exactly
        ``part.num_pages * fmt.page_bytes * num_layers``. Raises on any failure."""
        ...

    def recv_part(self, part: RankTransfer, receiver: DecodeReceiver) -> int:
        """Decode endpoint: return once ``part``'s bytes are in ``receiver``'s reserved slots
        (``receiver.place``/``place_packed`` for a two-sided transport, ``mark_written`` after
        one-sided writes completed). Returns the bytes received. Raises on failure or timeout;
        the caller then aborts the request."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """What a transfer plugin's ``load()`` returns."""

    name: str

    def connect(self, spec: LinkSpec) -> Link:
        """Join the transfer: a collective over all C + 1 endpoints (every endpoint calls it,
        once, after its pool exists). A one-sided transport exchanges the decode pool's buffer
        addresses here."""
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


@dataclass(frozen=True)
class Grant:
    """Decode -> each prefill endpoint: the reserved destination slots of its part (in the part's
    logical page order), or why the request was refused (nothing reserved then)."""

    request: str
    dst_slots: list[int] | None
    error: str | None = None


@dataclass(frozen=True)
class Ack:
    """Decode -> each prefill endpoint: the request was published, or not and why."""

    request: str
    published: bool
    error: str | None = None


# ---- side channels the core provides ---------------------------------------------------------

class DistSideChannel:
    """Messages over ``torch.distributed`` object point-to-point (``send_object_list``) in
    ``group`` (a Gloo group: the messages are tiny and stay on the host)."""

    def __init__(self, spec: LinkSpec, group: Any = None) -> None:
        self.spec, self.group = spec, group

    def send(self, peer: int, msg: Any) -> None:
        import torch.distributed as dist

        dist.send_object_list([msg], dst=self.spec.world_rank(peer), group=self.group)

    def recv(self, peer: int) -> Any:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.recv_object_list(box, src=self.spec.world_rank(peer), group=self.group)
        return box[0]


class StoreSideChannel:
    """Messages over a key-value store (``torch.distributed.TCPStore`` or any object with
    ``set(key, bytes)``, ``get(key)``, ``wait([key], timedelta)``, ``delete_key(key)``): a plain
    TCP side channel that needs no process group. Keys are ``{prefix}/{src}->{dst}/{seq}``."""

    def __init__(self, store: Any, endpoint: int, timeout_s: float, prefix: str = "cpkv-xfer") -> None:
        self.store, self.endpoint, self.timeout_s, self.prefix = store, endpoint, timeout_s, prefix
        self._sent: dict[int, int] = {}
        self._got: dict[int, int] = {}

    def _key(self, src: int, dst: int, seq: int) -> str:
        return f"{self.prefix}/{src}->{dst}/{seq}"

    def send(self, peer: int, msg: Any) -> None:
        seq = self._sent.get(peer, 0)
        self._sent[peer] = seq + 1
        self.store.set(self._key(self.endpoint, peer, seq), pickle.dumps(msg))

    def recv(self, peer: int) -> Any:
        seq = self._got.get(peer, 0)
        key = self._key(peer, self.endpoint, seq)
        self.store.wait([key], timedelta(seconds=self.timeout_s))
        msg = pickle.loads(self.store.get(key))
        self._got[peer] = seq + 1
        with contextlib.suppress(Exception):  # stores without delete keep the key; harmless
            self.store.delete_key(key)
        return msg
