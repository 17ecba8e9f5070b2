"""Peer memory: one byte buffer per rank of a CP group, every one readable from every rank.

The P2P materialization (``kv.materialize = "p2p"``) keeps each rank's KV pages in such a buffer
and builds the full view by reading the owners' pages directly (``peer_gather``): no send buffer,
no collective, no rank-major staging copy.

* CUDA (NCCL group): PyTorch symmetric memory (``torch.distributed._symmetric_memory``): the
  buffers of the ranks' GPUs are mapped into each other's address space (NVLink P2P). Ordering:
  :meth:`PeerBuffers.barrier` is the symmetric-memory device barrier, queued on the current
  stream (no host sync).
* CPU (Gloo group): one shared-memory file per rank (``/dev/shm``, else the temp directory),
  mapped by every rank and unlinked once all have mapped it (nothing is left behind). Ordering:
  a Gloo barrier (the CPU has no stream to queue on).
* A one-rank group: a plain buffer.

:func:`open_peer_buffers` is a collective. It raises :class:`PeerAccessUnavailable` on every rank
alike when any rank cannot map its peers (the caller falls back to the all-gather path).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .group import CPGroup

__all__ = ["PeerAccessUnavailable", "PeerBuffers", "open_peer_buffers"]


class PeerAccessUnavailable(RuntimeError):
    """This group cannot share memory between its ranks; the message says why (same on every
    rank)."""


@dataclass
class PeerBuffers:
    """``buffers[r]``: rank r's uint8 [nbytes] buffer as this process sees it (``buffers[rank]``
    is this rank's own). Keep the object alive while any view of a buffer is in use."""

    rank: int
    buffers: tuple[torch.Tensor, ...]
    kind: str  # "symmetric_memory", "shared_file" or "local"
    _barrier: Callable[[], None]
    _keep: list[Any] = field(default_factory=list, repr=False)

    @property
    def local(self) -> torch.Tensor:
        return self.buffers[self.rank]

    def barrier(self) -> None:
        """Every rank's work queued before this point (writes into its buffer) is done and
        visible before any rank's work queued after it (reads of peers' buffers) starts."""
        self._barrier()


def open_peer_buffers(group: CPGroup, nbytes: int) -> PeerBuffers:
    """Allocate ``nbytes`` on every rank and map every rank's buffer into every rank (collective).

    Raises:
        PeerAccessUnavailable: on every rank, when some rank could not (the reasons of the ranks
            that failed, joined).
        ValueError: ``nbytes`` < 1.
    """
    if nbytes < 1:
        raise ValueError(f"peer buffers need at least 1 byte, got {nbytes}")
    if group.is_local:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=group.device)
        return PeerBuffers(rank=0, buffers=(buf,), kind="local", _barrier=lambda: None)
    if group.device.type == "cuda":
        return _symmetric(group, nbytes)
    if group.device.type == "cpu":
        return _shared_files(group, nbytes)
    _fail_all(group, f"no peer memory on {group.device.type} devices")
    raise AssertionError("unreachable")


def _fail_all(group: CPGroup, reason: str | None) -> None:
    """Raise :class:`PeerAccessUnavailable` on every rank when any rank passes a reason."""
    ok = group.agree_all({"peer": reason is None})["peer"]
    if ok:
        return
    reasons = group.all_gather_object(reason)
    why = "; ".join(f"rank {r}: {m}" for r, m in enumerate(reasons) if m)
    raise PeerAccessUnavailable(why or "a rank could not map its peers")


def _symmetric(group: CPGroup, nbytes: int) -> PeerBuffers:
    err: str | None = None
    buf: torch.Tensor | None = None
    pg = group.process_group
    try:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # older torch needs the group enabled first
            with contextlib.suppress(Exception):
                enable(pg.group_name)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=group.device)
    except Exception as exc:  # no symmetric memory in this torch / driver
        err = f"symmetric memory allocation failed: {exc!r}"[:300]
    _fail_all(group, err)
    assert buf is not None  # _fail_all raised otherwise
    bufs: tuple[torch.Tensor, ...] = ()
    try:
        handle = symm_mem.rendezvous(buf, pg)
        bufs = tuple(buf if r == group.rank else handle.get_buffer(r, (nbytes,), torch.uint8)
                     for r in range(group.size))
    except Exception as exc:
        err = f"symmetric memory rendezvous failed: {exc!r}"[:300]
    _fail_all(group, err)
    buf.zero_()
    return PeerBuffers(rank=group.rank, buffers=bufs, kind="symmetric_memory",
                       _barrier=lambda: handle.barrier(channel=0), _keep=[handle])


def _shm_dir(need: int) -> str | None:
    for d in ("/dev/shm", tempfile.gettempdir()):
        try:
            st = os.statvfs(d)
        except OSError:
            continue
        if os.access(d, os.W_OK) and st.f_bavail * st.f_frsize >= need:
            return d
    return None


def _shared_files(group: CPGroup, nbytes: int) -> PeerBuffers:
    token = group.all_gather_object(uuid.uuid4().hex)[0]  # rank 0's names every file of the group
    err: str | None = None
    path = ""
    d = _shm_dir(nbytes)
    if d is None:
        err = f"no shared-memory directory with {nbytes} free bytes (/dev/shm, the temp dir)"
    else:
        path = os.path.join(d, f"cpkv-peer-{token}-{group.rank}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve now: ENOSPC here, not SIGBUS later
            finally:
                os.close(fd)
        except OSError as exc:
            err = f"cannot create {path}: {exc}"
            with contextlib.suppress(OSError):
                os.unlink(path)
    try:
        _fail_all(group, err)
        paths = group.all_gather_object(path)
        bufs: list[torch.Tensor] = []
        err = None
        try:
            for p in paths:
                bufs.append(torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8))
        except Exception as exc:
            err = f"cannot map a peer's buffer: {exc!r}"[:300]
        _fail_all(group, err)  # every rank mapped every file ...
    finally:
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)  # ... so the names can go: the mappings stay
    return PeerBuffers(rank=group.rank, buffers=tuple(bufs), kind="shared_file",
                       _barrier=group.barrier)
