"""The ``mooncake`` transport: one-sided writes of the prefill ranks' pages into the decode pool
with the Mooncake Transfer Engine (``P2PHANDSHAKE``: no metadata server).

Settings: the ``[transfer.mooncake]`` table (:class:`~cpkv_transfer_mooncake.settings.
MooncakeSettings`, validated once at connect; below ``mooncake.<key>`` for short). The link sees
the endpoint's registered buffers (``LinkSpec.buffers``), never its pool.

``connect`` (collective over the C + 1 endpoints): every endpoint initializes its own engine on
``mooncake.hostname`` with ``mooncake.protocol`` (``tcp`` by default) and registers its pool's
buffers (``PoolBuffers.parts``: per layer its regions, each a contiguous uint8 ``[pages, page
bytes]`` tensor with its own page bytes: a GLM-5 shared-indexer layer's pages hold no index-K).
The decode endpoint sends every prefill endpoint a :class:`Session`: its engine's
``host:rpc_port`` and the :class:`Layout` of its pool (per layer, each region's base address and
page bytes; pages);
each prefill endpoint answers :class:`Joined` (its engine came up, its pool has the same page
layout). The side channel is a ``StoreSideChannel`` on a ``TCPStore`` that the decode endpoint
hosts on ``mooncake.hostname`` (its port goes to the prefill endpoints over the endpoints'
``torch.distributed`` world), or on ``LinkSpec.store``: a timed-out wait leaves it usable for the
next request (a Gloo pair is closed by its first timeout).

``send_part`` turns a part into write entries: its runs are split where the destination slots are
not consecutive, pieces that continue each other in both source and destination are merged, and
each piece moves as one entry per layer and region (a one-tensor layer: latent and index-K
together). Entries go in batches of at most
``mooncake.max_batch_entries`` (<= 1024: more than ~2048 entries in flight to one peer break the
engine's path to it) with ``batch_transfer_sync_write``; a failed batch is retried
``mooncake.retries`` times, each on a fresh engine (a failed path stays broken in the old one),
then the part fails (and the sender renews its engine for the next request: the old engine is
destroyed before ``send_part`` raises, so none of its writes can land later). Before each batch
the sender checks the decode's fence (``fenced``): a given-up grant gets no more writes. The
core's sender worker then tells the decode endpoint ``Done`` (with the error, if any); the decode
marks the part written. A failed part publishes nothing, and its slots stay in quarantine until
every sender of it is done (the core: docs/transfer.md, "Late writes").

Host staging (``mooncake.stage``; ``auto``: CUDA pools over ``tcp`` and other protocols that
copy device memory through the host). Mooncake's TCP transport copies each slice (64 KiB) of a
device source with a synchronous ``cudaMemcpy`` in its worker thread (``ClientSession::writeBody``
in tcp_transport); on the legacy default stream that waits for every kernel the prefill queued
and holds back the later ones, so the sends slowed the prefill by their own duration. Instead the
sender gathers the part's pages of the layer(s) it sends into a pinned host buffer registered
with the engine (:class:`HostStaging`, ``mooncake.stage_mb``; a larger send goes in pieces, each
staged and written before the next) on a non-blocking side stream that only the sender thread
synchronizes, and the entries' sources are the staging buffer (runs merged where the destination
slots are consecutive: :func:`staged_entries`). The staging buffer is registered with every
engine the link makes (retries included) and freed at ``close`` after its engine is gone.

Between GPUs of one host (``mooncake.protocol = "nvlink_intra"``, :mod:`.nvlink`): the
transport checks at connect, before any collective, that the wheel, the pool's device and its
memory allow it (else :class:`~cpkv_transfer_mooncake.nvlink.ProtocolRefused` naming every
reason), sets ``MC_INTRANODE_NVLINK=1`` before it imports the engine, and initializes it with
protocol ``tcp`` (the engine picks the transport from the environment). The engine reads the
pool's device memory itself: no host staging; a staging the decode's other page layout needs
stays in device memory. ``MC_FORCE_TCP`` overrides: plain TCP (a reported fallback), staged.

Engine facts this module relies on (the wheel's Python bindings as observed): positional arguments
only; no method may be called before a successful ``initialize`` (segfault), so an engine whose
``initialize`` failed is kept, never touched; results are int codes; ``del`` releases an engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cpkv.disagg.api import (
    BufferLayout,
    FallbackReason,
    KVBufferSpec,
    LinkSpec,
    PartSink,
    PoolBuffers,
    RankTransfer,
    SideChannel,
    TransferError,
    TransferFenced,
    get_logger,
    read_pages,
    region_bytes,
    report_fallback,
    store_side_channel,
    write_pages,
)

from .nvlink import NVLINK_INTRA, ProtocolRefused, ProtocolSetup, plan_protocol, prepare_environment
from .settings import DIRECT_PROTOCOLS, MooncakeSettings

__all__ = ["HostStaging", "Joined", "Layout", "MooncakeLink", "MooncakeTransport", "Session",
           "link_protocol",
           "stage_pieces", "stage_reason", "staged_entries", "write_entries"]

log = get_logger(__name__)

# engines whose initialize failed: any call on them, the destructor included, may crash the
# process, so they are kept alive and never touched
_UNTOUCHABLE: list[Any] = []


# ---- side-channel messages -------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    """One region of an endpoint's pool in its process: the pages of one layer's part (a page
    of it is ``page_bytes`` bytes at ``addr + slot x page_bytes``)."""

    addr: int
    page_bytes: int


@dataclass(frozen=True)
class Layout:
    """Where an endpoint's pool lives in its process: per layer, the regions of its pages
    (``PoolBuffers.parts``), each with its own page bytes (a GLM-5 shared-indexer layer's pages
    hold no index-K: fewer bytes than a full layer's)."""

    layers: tuple[tuple[Region, ...], ...]
    num_pages: int

    @classmethod
    def of(cls, buffers: PoolBuffers) -> Layout:
        """Raises: ValueError: a region is not contiguous."""
        for parts in buffers.parts:
            if not all(t.is_contiguous() for t in parts):
                raise ValueError("the Mooncake transfer needs contiguous pool buffers")
        return cls(layers=tuple(tuple(Region(int(t.data_ptr()), int(t[0].nbytes)) for t in parts)
                                for parts in buffers.parts),
                   num_pages=buffers.num_pages)

    @property
    def kv(self) -> tuple[int, ...]:
        """Per layer, the base address of its first region."""
        return tuple(parts[0].addr for parts in self.layers)

    def page_bytes(self, layer: int) -> int:
        """Bytes of one page of ``layer``, over its regions."""
        return sum(r.page_bytes for r in self.layers[layer])

    def shape(self) -> tuple[tuple[int, ...], ...]:
        """Per layer, its regions' page bytes."""
        return tuple(tuple(r.page_bytes for r in parts) for parts in self.layers)

    def buffers(self) -> list[tuple[int, int]]:
        """(address, bytes) of every region, for registration."""
        return [(r.addr, r.page_bytes * self.num_pages) for parts in self.layers for r in parts]

    def same_pages_as(self, other: Layout) -> bool:
        """The same layers with the same page bytes each (their regions may differ: a page
        staged in the other's layout)."""
        return ([self.page_bytes(i) for i in range(len(self.layers))]
                == [other.page_bytes(i) for i in range(len(other.layers))])

    def describe(self) -> str:
        """``layers x page bytes`` for messages (each distinct size counted)."""
        sizes = [self.page_bytes(i) for i in range(len(self.layers))]
        return ", ".join(f"{sizes.count(b)} x {b}" for b in sorted(set(sizes)))


@dataclass(frozen=True)
class Session:
    """Decode -> every prefill endpoint at connect: its engine's address and pool layout."""

    address: str  # "host:rpc_port"
    layout: Layout | None
    protocol: str
    error: str | None = None
    #: the decode pool's layout (``BufferLayout`` value): senders write their pages in it
    page_layout: str = BufferLayout.TOKEN_MAJOR.value


@dataclass(frozen=True)
class Joined:
    """Prefill endpoint -> decode at connect: its engine is up (or why not)."""

    endpoint: int
    error: str | None = None


# ---- write entries ---------------------------------------------------------------------------

def _src_slots(part: RankTransfer, dst_slots: Sequence[int], src: Layout,
               dst: Layout) -> list[int]:
    """The part's source slots in its page order, after checking them and ``dst_slots``.

    Raises:
        ValueError: slot count or a slot out of range, or pools of different page layouts.
    """
    if len(dst_slots) != part.num_pages:
        raise ValueError(f"{len(dst_slots)} destination slots for {part.num_pages} pages")
    if not src.same_pages_as(dst):
        raise ValueError("the prefill and decode pools have different page layouts")
    out = [run.src_slot + i for run in part.runs for i in range(run.num_pages)]
    for s, d in zip(out, dst_slots, strict=True):
        if not (0 <= s < src.num_pages and 0 <= int(d) < dst.num_pages):
            raise ValueError(f"page slot out of range: source {s} of {src.num_pages}, "
                             f"destination {d} of {dst.num_pages}")
    return out


def write_entries(part: RankTransfer, dst_slots: Sequence[int], src: Layout,
                  dst: Layout, layers: range | None = None) -> list[tuple[int, int, int]]:
    """``(local address, remote address, length)`` per coalesced piece x layer (of ``layers``,
    default every layer) x region of the layer (each its own page bytes), read from the pool
    itself (no staging; both pools' regions alike).

    A piece is a range of pages consecutive in both the source and the destination slots: runs
    split where ``dst_slots`` jump, pieces merged where they continue each other.

    Raises:
        ValueError: slot count or a slot out of range, or pools of different page layouts or
            regions.
    """
    pieces: list[list[int]] = []  # [src slot, dst slot, pages]
    for s, d in zip(_src_slots(part, dst_slots, src, dst), map(int, dst_slots), strict=True):
        if pieces and pieces[-1][0] + pieces[-1][2] == s and pieces[-1][1] + pieces[-1][2] == d:
            pieces[-1][2] += 1
        else:
            pieces.append([s, d, 1])
    if src.shape() != dst.shape():
        raise ValueError(f"the pools' regions differ ({src.shape()[:2]}... vs "
                         f"{dst.shape()[:2]}...): the pages are staged in the decode's layout")
    out: list[tuple[int, int, int]] = []
    for s, d, n in pieces:
        for layer in range(len(src.layers)) if layers is None else layers:
            for a, b in zip(src.layers[layer], dst.layers[layer], strict=True):
                out.append((a.addr + s * a.page_bytes, b.addr + d * b.page_bytes,
                            n * a.page_bytes))
    return out


def stage_pieces(num_pages: int, layers: range, page_bytes: Sequence[int],
                 capacity: int) -> list[tuple[range, int, int]]:
    """How a send of ``num_pages`` pages x ``layers`` is cut to fit a staging buffer of
    ``capacity`` bytes (>= one page): ``(layers, first page, end page)`` per piece, in order.
    ``page_bytes[layer]``: one page of that layer (layers may differ). Consecutive whole layers
    while they fit; a layer that does not fit alone goes in page ranges."""
    if num_pages == 0 or len(layers) == 0:
        return []
    out: list[tuple[range, int, int]] = []
    group: list[int] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if group:
            out.append((range(group[0], group[-1] + 1), 0, num_pages))
            group.clear()
            size = 0

    for layer in layers:
        pb = page_bytes[layer]
        per_layer = num_pages * pb
        if per_layer > capacity:
            flush()
            if capacity < pb:
                raise ValueError(f"a staging buffer of {capacity} bytes holds no page of {pb}")
            step = capacity // pb
            out += [(range(layer, layer + 1), k, min(k + step, num_pages))
                    for k in range(0, num_pages, step)]
            continue
        if size + per_layer > capacity:
            flush()
        group.append(layer)
        size += per_layer
    flush()
    return out


def staged_entries(dst_slots: Sequence[int], first: int, end: int, base: int, dst: Layout,
                   layers: range) -> list[tuple[int, int, int]]:
    """Write entries of a staged piece: pages ``first..end`` (part order) of ``layers``, staged
    at ``base`` layer after layer and, in a layer, region after region of the decode's layout
    (region ``r`` of layer ``j`` of the piece after the piece's earlier regions, ``end - first``
    pages each). The staged pages are consecutive, so a run splits only where ``dst_slots``
    jump."""
    n = end - first
    runs: list[list[int]] = []  # [page offset in the piece, dst slot, pages]
    for k in range(first, end):
        d = int(dst_slots[k])
        if runs and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([k - first, d, 1])
    out: list[tuple[int, int, int]] = []
    at = base
    for layer in layers:
        for reg in dst.layers[layer]:
            pb = reg.page_bytes
            out += [(at + off * pb, reg.addr + d * pb, cnt * pb) for off, d, cnt in runs]
            at += n * pb
    return out


def stage_reason(mode: str, device_type: str, protocol: str,
                 relayout: bool = False) -> str | None:
    """Why the sender stages through host memory (None: it does not) under ``transfer.mooncake.stage``.
    ``relayout``: the decode pool's page layout differs from the sender's; the pages are re-laid
    out while staged (whatever the mode: the decode takes the bytes as they land)."""
    if mode == "host":
        return "transfer.mooncake.stage = 'host'"
    if relayout:
        return ("the decode pool's page layout differs: pages are re-laid out while staged "
                "(the decode would otherwise rewrite every page after the last Done)")
    if mode == "none":
        return None
    if device_type != "cuda":
        return None  # the pool is in host memory already
    if protocol in DIRECT_PROTOCOLS:
        return None
    return (f"a CUDA pool over {protocol!r}: the engine would copy each slice of device memory "
            f"with a synchronous cudaMemcpy that stalls the prefill's compute")


def relayout_pages(buffers: PoolBuffers, layer: int, idx: Any, out: Any,
                   dst: BufferLayout) -> None:
    """Write pages ``idx`` (int64 [n]) of ``layer`` of ``buffers`` into ``out`` (uint8, the
    layer's ``n`` pages' bytes) laid out as the decode pool's regions are in layout ``dst``
    (region after region, ``n`` pages each: what :func:`staged_entries` writes from): each
    part's token rows read from the pool's layout and stored into a one-layer spec over ``out``
    (token-major = each token's latent then its index-K bytes; part-major = the page's ps latent
    rows, then its ps index-K rows; two-part = the latent block, then the index-K in DeepGEMM's
    page order)."""
    import torch

    fmt, n = buffers.fmts[layer], int(idx.shape[0])
    ps, at, parts = fmt.page_size, 0, []
    for b in region_bytes(fmt, dst):
        parts.append(out[at:at + n * b])
        at += n * b
    if dst is BufferLayout.TWO_PART:
        tensors: list[Any] = [(parts[0].view(n, ps, -1), parts[1].view(n, -1) if fmt.index_k
                               else None)]
    else:
        tensors = [parts[0].view(n, ps, -1)]
    over = KVBufferSpec.wrap(fmt, dst, tensors)
    blocks = read_pages(buffers.spec, layer, idx)
    write_pages(over, 0, torch.arange(n, device=blocks.device), blocks)


class HostStaging:
    """The sender's staging buffer: pages are gathered into it (one ``index_select`` per layer
    and piece) and the engine writes from it.

    CUDA pools: a pinned host buffer; the gather runs on a side stream of its own (PyTorch's
    pool streams are created ``cudaStreamNonBlocking``: no implicit order with the legacy
    default stream the prefill computes on) into a device scratch of the same size, then one
    asynchronous copy into the pinned buffer; :meth:`fill` synchronizes that side stream only.
    The layer's KV write is complete before: the core's sender worker waits for the layer's
    CUDA event before it calls ``send_part``, and the gather is queued after that wait.
    CPU pools: ``index_select(out=)`` straight into the host buffer (pinned when CUDA is there).
    ``on_device`` (a CUDA pool under ``nvlink_intra``, whose engine maps only GPU memory): the
    device scratch is the buffer the engine writes from; no host buffer.
    """

    def __init__(self, buffers: PoolBuffers, nbytes: int, on_device: bool = False) -> None:
        import torch

        #: per layer, bytes of one of its pages (layers may differ)
        self.page_bytes = tuple(buffers.layer_page_bytes(i) for i in range(buffers.num_layers))
        self.nbytes = max(int(nbytes), max(self.page_bytes))
        dev = buffers.device
        self.device = dev
        pages = buffers.num_pages
        if on_device and dev.type != "cuda":
            raise ValueError(f"device staging for a pool on {dev}: it needs a CUDA pool")
        self.on_device = on_device
        pin = dev.type == "cuda" or torch.cuda.is_available()
        host = None if on_device else torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host: Any = host
        self.idx_host: Any = torch.empty(pages, dtype=torch.int64, pin_memory=pin)
        self.addr = 0 if host is None else int(host.data_ptr())
        self.stream: Any = None
        self.scratch: Any = None
        self.idx_dev: Any = None
        if dev.type == "cuda":
            self.stream = torch.cuda.Stream(device=dev)
            with torch.cuda.device(dev):
                self.scratch = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
                self.idx_dev = torch.empty(pages, dtype=torch.int64, device=dev)
            if on_device:
                self.addr = int(self.scratch.data_ptr())

    def fill(self, buffers: PoolBuffers, layers: range, slots: Sequence[int],
             relayout: BufferLayout | None = None) -> None:
        """Stage the pages ``slots`` of ``layers`` (layer after layer; in a layer, region after
        region of ``buffers.parts``, each its own page bytes) at :attr:`addr`; returns once the
        bytes are in the buffer the engine writes from. ``relayout``: the decode pool's layout
        when it differs from this pool's; each page is rewritten in it on the way
        (:func:`relayout_pages`)."""
        import torch

        n = len(slots)
        size = n * sum(self.page_bytes[layer] for layer in layers)
        if size > self.nbytes:
            raise ValueError(f"{size} bytes to stage in a buffer of {self.nbytes}")
        self.idx_host[:n].copy_(torch.as_tensor(list(slots), dtype=torch.int64))

        def gather(buf: Any, idx: Any) -> None:
            at = 0
            for layer in layers:
                if relayout is not None:
                    out = buf[at:at + n * self.page_bytes[layer]]
                    relayout_pages(buffers, layer, idx, out, relayout)
                    at += out.numel()
                    continue
                for part in buffers.parts[layer]:
                    m = n * int(part[0].numel())
                    torch.index_select(part, 0, idx, out=buf[at:at + m].view(n, -1))
                    at += m

        if self.stream is None:
            gather(self.host, self.idx_host[:n])
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            idx = self.idx_dev[:n]
            idx.copy_(self.idx_host[:n], non_blocking=True)
            gather(self.scratch, idx)
            if self.host is not None:
                self.host[:size].copy_(self.scratch[:size], non_blocking=True)
        self.stream.synchronize()  # the side stream only: never the compute stream

    def close(self) -> None:
        """Free the buffers (unregister them from the engine first)."""
        self.host = self.idx_host = self.scratch = self.idx_dev = self.stream = None


# ---- the engine ------------------------------------------------------------------------------

class _Engine:
    """One initialized TransferEngine with the pool's buffers registered."""

    def __init__(self, engine_cls: Any, opts: MooncakeSettings,
                 buffers: Sequence[tuple[int, int]], protocol: str | None = None) -> None:
        """``protocol``: ``initialize``'s argument (default ``opts.protocol``; ``"tcp"`` for
        ``nvlink_intra``, which the environment selects)."""
        eng = engine_cls()
        proto = opts.protocol if protocol is None else protocol
        rc = eng.initialize(opts.hostname, "P2PHANDSHAKE", proto, "")
        if rc != 0:
            _UNTOUCHABLE.append(eng)
            raise TransferError(f"Mooncake initialize({opts.hostname!r}, 'P2PHANDSHAKE', "
                                f"{proto!r}) returned {rc}")
        self.eng: Any = eng
        self.address = f"{opts.hostname}:{eng.get_rpc_port()}"
        self.registered: list[int] = []
        for addr, n in buffers:
            if n == 0:
                continue
            rc = eng.register_memory(addr, n)
            if rc != 0:
                self.close()
                hint = ""
                if opts.protocol == NVLINK_INTRA:  # its registration exports a CUDA IPC handle
                    hint = (" (nvlink_intra exports the buffer's allocation with "
                            "cudaIpcGetMemHandle: it must be plain cudaMalloc memory, not "
                            "peer-mapped symmetric memory: set kv.materialize = 'all_gather' "
                            "where 'auto' or 'p2p' maps the pool across CP ranks)")
                raise TransferError(f"Mooncake register_memory of {n} bytes at {addr:#x} returned "
                                    f"{rc}{hint}")
            self.registered.append(addr)

    def write(self, peer: str, entries: Sequence[tuple[int, int, int]]) -> int:
        return int(self.eng.batch_transfer_sync_write(peer, [e[0] for e in entries],
                                                      [e[1] for e in entries],
                                                      [e[2] for e in entries]))

    def close(self) -> None:
        if self.eng is None:
            return
        for addr in self.registered:
            self.eng.unregister_memory(addr)
        self.registered = []
        eng, self.eng = self.eng, None
        del eng  # the engine's destructor stops its threads and closes its listener (~1 s)


def _side_channel(spec: LinkSpec, hostname: str) -> tuple[SideChannel, Any]:
    """The core's store side channel (``cpkv.disagg.store_side_channel``)."""
    return store_side_channel(spec, hostname, "cpkv-mooncake")


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class MooncakeLink:
    """One endpoint's link (see ``cpkv.disagg.transport.Link``).

    Attributes:
        remote: decode engine's ``host:port`` (prefill endpoints; the decode's own on decode).
        opts: the plugin's settings (``[transfer.mooncake]``).
        max_batch: entries per batch write (``transfer.mooncake.max_batch_entries``).
        stats: ``batches``, ``entries``, ``largest_batch``, ``retries``, ``staged_pieces`` so
            far (prefill).
        stage: the sender's :class:`HostStaging` (``transfer.mooncake.stage``), or None: the
            engine reads the pool itself.
        one_sided: True: the writes land in the decode pool's slots themselves.
    """

    one_sided = True
    #: the pages land in the decode pool's own layout (senders re-lay them out while staged)
    writes_receiver_layout = True

    def __init__(self, spec: LinkSpec, engine_cls: Any) -> None:
        """Raises: SettingsError (a bad ``[transfer.mooncake]``), ProtocolRefused (the protocol
        cannot run here: both before any collective), TransferError (an engine failed on some
        endpoint)."""
        self.opts = spec.options.parse(MooncakeSettings)
        self.setup = link_protocol(self.opts, spec.buffers.device.type)
        self.spec = spec
        self.max_batch = self.opts.max_batch_entries
        self.retries = self.opts.retries
        self._engine_cls = engine_cls
        self.local = Layout.of(spec.buffers)
        self.engine: _Engine | None = None
        self.remote = ""
        self.remote_layout: Layout | None = None
        self.stats = {"batches": 0, "entries": 0, "largest_batch": 0, "retries": 0,
                      "staged_pieces": 0}
        self.stage: HostStaging | None = None
        #: the decode pool's layout when it differs from this pool's
        self.relayout: BufferLayout | None = None
        self.channel, self._store = _side_channel(spec, self.opts.hostname)
        if spec.is_decode:
            self._connect_decode()
        else:
            self._connect_prefill()

    # ---- connect ---------------------------------------------------------------------------

    def _connect_decode(self) -> None:
        spec, err = self.spec, None
        try:
            self.engine = _Engine(self._engine_cls, self.opts, self.local.buffers(),
                                  self.setup.engine)
            session = Session(self.engine.address, self.local, self.setup.effective,
                              page_layout=spec.buffers.layout.value)
            self.remote, self.remote_layout = self.engine.address, self.local
        except Exception as exc:
            err = exc
            session = Session("", None, self.setup.effective, _why(exc))
        for r in range(spec.cp_size):
            self.channel.send(r, session)
        if err is not None:
            raise TransferError(f"mooncake connect: the decode engine failed: {_why(err)}") from err
        bad = []
        for r in range(spec.cp_size):
            j = self.channel.recv(r)
            if not isinstance(j, Joined) or j.error is not None:
                bad.append(f"rank {r}: {j.error if isinstance(j, Joined) else j!s}")
        if bad:
            self.close()
            raise TransferError(f"mooncake connect: prefill endpoints failed: {'; '.join(bad)}")

    def _buffers(self) -> list[tuple[int, int]]:
        """What an engine of this endpoint registers: the pool's buffers and the staging one."""
        extra = [(self.stage.addr, self.stage.nbytes)] if self.stage is not None else []
        return self.local.buffers() + extra

    def _make_stage(self, decode_layout: BufferLayout) -> None:
        """The sender's staging decision (``transfer.mooncake.stage``; always when the decode
        pool's page layout differs), logged; the buffer is made here."""
        bufs, o = self.spec.buffers, self.opts
        self.relayout = None if bufs.layout is decode_layout else decode_layout
        proto = self.setup.effective
        why = stage_reason(o.stage, bufs.device.type, proto, relayout=self.relayout is not None)
        if why is not None:  # nvlink_intra maps GPU memory only: its staging stays there
            self.stage = HostStaging(bufs, int(float(o.stage_mb) * (1 << 20)),
                                     on_device=self.setup.intra_nvlink)
        log.info("cpkv.mooncake.stage", endpoint=self.spec.endpoint, stage=o.stage,
                 protocol=proto, pool_device=str(bufs.device),
                 staged=why is not None, reason=why or "the engine reads the pool itself",
                 buffer_bytes=self.stage.nbytes if self.stage is not None else 0,
                 on_device=bool(self.stage is not None and self.stage.on_device),
                 pinned=bool(self.stage is not None and self.stage.host is not None
                             and self.stage.host.is_pinned()))

    def _connect_prefill(self) -> None:
        spec, err = self.spec, None
        session = self.channel.recv(spec.decode_endpoint)  # the decode does not wait for us
        if not isinstance(session, Session) or session.error is not None or session.layout is None:
            self.close()
            raise TransferError(f"mooncake connect: the decode engine failed: "
                                f"{session.error if isinstance(session, Session) else session}")
        try:
            self._make_stage(BufferLayout(session.page_layout))
            self.engine = _Engine(self._engine_cls, self.opts, self._buffers(), self.setup.engine)
        except Exception as exc:
            err = _why(exc)
        if err is None and session.protocol != self.setup.effective:
            err = (f"the decode endpoint runs protocol {session.protocol!r}, this one "
                   f"{self.setup.effective!r} (set MC_FORCE_TCP alike on every endpoint)")
        if err is None and not self.local.same_pages_as(session.layout):
            err = (f"page layouts differ: this pool's layers x bytes per page "
                   f"{self.local.describe()}, the decode pool's {session.layout.describe()}")
        self.channel.send(spec.decode_endpoint, Joined(spec.endpoint, err))
        if err is not None:
            self.close()
            raise TransferError(f"mooncake connect: rank {spec.endpoint}: {err}")
        self.remote, self.remote_layout = session.address, session.layout

    # ---- data ------------------------------------------------------------------------------

    def _renew_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        self.engine = _Engine(self._engine_cls, self.opts, self._buffers(), self.setup.engine)

    def _write(self, batch: Sequence[tuple[int, int, int]]) -> None:
        attempts = 1 + self.retries
        rc = 0
        for a in range(attempts):
            if a:
                report_fallback(op="mooncake:batch_transfer_sync_write",
                                requested="one attempt", selected=f"retry {a} of {self.retries} "
                                "on a fresh engine", reason=FallbackReason.TRANSFER_RETRY,
                                detail=f"{len(batch)} entries to {self.remote} returned {rc}")
                self.stats["retries"] += 1
                self._renew_engine()  # the failed path to the peer stays broken in the old one
            assert self.engine is not None
            rc = self.engine.write(self.remote, batch)
            if rc == 0:
                self.stats["batches"] += 1
                self.stats["entries"] += len(batch)
                self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
                return
        raise TransferError(f"batch_transfer_sync_write of {len(batch)} entries "
                            f"({sum(e[2] for e in batch)} bytes) to {self.remote} returned {rc} "
                            f"after {attempts} attempt(s)")

    def send_part(self, part: RankTransfer, dst_slots: Sequence[int], *,
                  layers: range | None = None, epoch: int = 0,
                  fenced: Callable[[], bool] | None = None) -> int:
        """Write the part's pages of ``layers`` (default every layer) into the decode pool, in
        batches; ``fenced`` is checked before each batch (a given-up grant gets no more writes).

        Raises:
            TransferError: a batch failed (after the retries; the failed engine is destroyed
                first, so none of its writes can land later), the grant was fenced, or the slots
                are wrong.
        """
        spec = self.spec
        n = spec.buffers.nbytes(part.num_pages, layers)
        entries: list[tuple[int, int, int]] = []
        try:
            if self.engine is None or self.remote_layout is None:
                raise TransferError("the link is closed")
            stage = self.stage
            if stage is None:
                entries = write_entries(part, dst_slots, self.local, self.remote_layout, layers)
                self._write_batches(entries, 0, len(entries), epoch, fenced)
            else:
                entries = self._send_staged(stage, part, dst_slots, layers, epoch, fenced)
        except Exception as exc:
            fenced_off = isinstance(exc, TransferFenced)  # the engine is fine: keep it
            if isinstance(exc, TransferError) and not fenced_off and self.engine is not None:
                # a failed write leaves the engine's path to the peer broken (also for the next
                # request), and a write of it might still land: a fresh engine replaces it
                with contextlib.suppress(Exception):
                    self._renew_engine()
            kind = TransferFenced if fenced_off else TransferError
            raise kind(f"mooncake: rank {spec.endpoint} failed writing its part of "
                       f"{part.request!r} ({part.num_pages} pages, {len(entries)} "
                       f"entries) to {self.remote or '?'}: {_why(exc)}") from exc
        return n

    def _write_batches(self, entries: Sequence[tuple[int, int, int]], done: int, total: int,
                       epoch: int, fenced: Callable[[], bool] | None) -> None:
        """``entries`` in batches of at most ``max_batch``, the fence checked before each
        (``done`` of ``total`` entries of the part were written before these)."""
        for i in range(0, len(entries), self.max_batch):
            if fenced is not None and fenced():
                raise TransferFenced(f"fenced: the decode gave grant {epoch} up; "
                                     f"{done + i} of {total} entries written")
            self._write(entries[i:i + self.max_batch])

    def _send_staged(self, stage: HostStaging, part: RankTransfer, dst_slots: Sequence[int],
                     layers: range | None, epoch: int,
                     fenced: Callable[[], bool] | None) -> list[tuple[int, int, int]]:
        """Stage the part piece by piece (:func:`stage_pieces`) and write each piece from the
        staging buffer (a piece's writes return before the next piece overwrites it: the sync
        write is done with the buffer once it returns). Returns every entry written."""
        assert self.remote_layout is not None
        slots = _src_slots(part, dst_slots, self.local, self.remote_layout)
        lays = range(self.spec.buffers.num_layers) if layers is None else layers
        plan = [(p, staged_entries(dst_slots, p[1], p[2], stage.addr, self.remote_layout, p[0]))
                for p in stage_pieces(len(slots), lays, stage.page_bytes, stage.nbytes)]
        total = sum(len(e) for _, e in plan)
        done = 0
        for (plays, first, end), ents in plan:
            stage.fill(self.spec.buffers, plays, slots[first:end], self.relayout)
            self.stats["staged_pieces"] += 1
            self._write_batches(ents, done, total, epoch, fenced)
            done += len(ents)
        return [e for _, ents in plan for e in ents]

    def recv_part(self, part: RankTransfer, sink: PartSink, *,
                  layers: range | None = None, epoch: int = 0) -> int:
        """One-sided: the bytes are in place when the sender's ``Done`` arrived (the core
        waits for it); nothing to receive here."""
        return 0

    def close(self) -> None:
        """Unregister the pool's (and the staging) buffers, release the engine, then free the
        staging buffer (idempotent)."""
        if self.engine is not None:
            eng, self.engine = self.engine, None
            eng.close()
        if self.stage is not None:
            self.stage.close()
            self.stage = None
        self._store = None


def link_protocol(opts: MooncakeSettings, device_type: str) -> ProtocolSetup:
    """How a link of these settings runs its protocol (:func:`.nvlink.plan_protocol`); an
    ``MC_FORCE_TCP`` override of ``nvlink_intra`` is reported as a fallback.

    Raises:
        ProtocolRefused: the protocol cannot run here (every reason named).
    """
    setup = plan_protocol(opts.protocol, device_type)
    if setup.intra_nvlink and opts.stage == "host":
        raise ProtocolRefused("transfer.mooncake.protocol = 'nvlink_intra' refused: "
                              "transfer.mooncake.stage = 'host' stages in host memory, which the "
                              "transport cannot map (use stage = 'auto' or 'none')")
    if setup.forced_tcp:
        report_fallback(op="mooncake:protocol", requested=setup.configured, selected="tcp",
                        reason=FallbackReason.TRANSFER_FORCED_TCP,
                        detail="MC_FORCE_TCP is set: the engine moves the pages over TCP")
    return setup


class MooncakeTransport:
    """What ``plugin.load()`` returns, holding the function that imports the engine class
    (``mooncake.engine.TransferEngine``; this module never imports the plugin module). The
    engine is imported at the first ``connect``, once the protocol's environment is set."""

    name = "mooncake"

    def __init__(self, load_engine: Callable[[], Any]) -> None:
        self.load_engine = load_engine
        self.engine_cls: Any = None

    def connect(self, spec: LinkSpec) -> MooncakeLink:
        """Raises: SettingsError, ProtocolRefused (before the engine is imported and before any
        collective), RuntimeError (the engine cannot be imported), TransferError."""
        opts = spec.options.parse(MooncakeSettings)
        prepare_environment(plan_protocol(opts.protocol, spec.buffers.device.type))
        if self.engine_cls is None:
            self.engine_cls = self.load_engine()
        return MooncakeLink(spec, self.engine_cls)
