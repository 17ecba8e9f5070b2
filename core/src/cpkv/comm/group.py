"""One context-parallel group: a thin wrapper over a ``torch.distributed`` process group.

:class:`CPGroup` is the only thing the rest of cpkv talks to for cross-rank communication. Every
method is a *collective*: all ranks of the group call it, in the same order, with the same shapes
(contract rule 16). Every wait is bounded by the process group's timeout (``timeout_s``, from
:class:`cpkv.settings.RuntimeSettings`).

Costs (collectives per call, host syncs):

* :meth:`CPGroup.all_gather_rows`: one ``all_gather_single`` of raw bytes; no host sync.
* :meth:`CPGroup.agree_all`: one ``all_reduce(MIN)`` of ``len(keys) + 2`` int64; one host sync.
* :meth:`CPGroup.agree_min`: one ``all_reduce(MIN)`` of a few int64; one host sync.
* :meth:`CPGroup.all_equal`: one ``all_gather_object`` (two collectives inside torch); host sync.
* :meth:`CPGroup.check_all`: one ``all_reduce(MIN)``; plus one ``all_gather_object`` only when some
  rank failed (every rank takes the same branch); host sync.
* :meth:`CPGroup.barrier`: one barrier.
* :meth:`CPGroup.all_gather_object`: one ``all_gather_object``; host sync (setup and error paths).

Peer-mapped buffers over a group (:func:`cpkv.comm.peer.open_peer_buffers`) are built from these.

:meth:`CPGroup.single` is a size-1 group that needs no ``torch.distributed`` at all.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from typing import Literal, TypeVar

import torch
import torch.distributed as dist

from ._waits import waiting_in

__all__ = ["Backend", "CPGroup", "CollectiveCheckError"]

Backend = Literal["gloo", "nccl", "local"]
T = TypeVar("T")


# torch >= 2.13 names the one-tensor all-gather all_gather_single (all_gather_into_tensor warns
# there); older releases only have all_gather_into_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveCheckError(ValueError):
    """Raised on *every* rank by :meth:`CPGroup.check_all` when at least one rank failed the check.

    Attributes:
        failures: failing rank -> the message that rank passed, in rank order.
    """

    def __init__(self, failures: dict[int, str], size: int) -> None:
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        detail = "; ".join(f"rank {r}: {m}" for r, m in self.failures.items())
        super().__init__(f"collective check failed on rank(s) {ranks} of {size}: {detail}")


class CPGroup:
    """One CP group of ``size`` ranks; this process is ``rank``.

    Attributes:
        rank: this process's rank in the group, ``0 <= rank < size``.
        size: number of ranks C.
        device: where collective buffers live: ``cuda:<local rank>`` under NCCL, ``cpu`` under
            Gloo and for :meth:`single`.
        backend: ``"gloo"``, ``"nccl"``, or ``"local"`` for :meth:`single`.
        timeout_s: bound on every collective wait (the process group's timeout).
    """

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        backend: Backend,
        device: torch.device,
        timeout_s: float,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for group size {size}")
        if backend == "local" and size != 1:
            raise ValueError("a 'local' group has exactly one rank")
        self.rank = rank
        self.size = size
        self.backend: Backend = backend
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        self._pg = process_group  # None: the default group (or no group at all when local)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def single(cls, device: torch.device | str = "cpu", timeout_s: float = 120.0) -> CPGroup:
        """A size-1 group; every method works locally without ``torch.distributed``."""
        return cls(rank=0, size=1, backend="local", device=torch.device(device), timeout_s=timeout_s)

    @classmethod
    def from_process_group(
        cls,
        process_group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 120.0,
        device: torch.device | str | None = None,
    ) -> CPGroup:
        """Wrap an initialized process group (``None``: the default group).

        ``device`` defaults to ``cpu`` under Gloo and to ``cuda:<LOCAL_RANK>`` under NCCL
        (``LOCAL_RANK`` from the environment, else the current CUDA device).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialized.
            ValueError: the backend is neither Gloo nor NCCL.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized; use CPGroup.single() for one rank")
        backend = str(dist.get_backend(process_group)).lower()
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unsupported process group backend {backend!r} (gloo or nccl)")
        if device is None:
            if backend == "nccl":
                local = os.environ.get("LOCAL_RANK")
                index = int(local) if local is not None else torch.cuda.current_device()
                device = torch.device("cuda", index)
            else:
                device = torch.device("cpu")
        return cls(
            rank=dist.get_rank(process_group),
            size=dist.get_world_size(process_group),
            backend=backend,  # type: ignore[arg-type]
            device=torch.device(device),
            timeout_s=timeout_s,
            process_group=process_group,
        )

    def __repr__(self) -> str:
        return (
            f"CPGroup(rank={self.rank}, size={self.size}, backend={self.backend!r}, "
            f"device={str(self.device)!r}, timeout_s={self.timeout_s})"
        )

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The ``torch.distributed`` process group (the default group when none was given).

        Raises:
            RuntimeError: a ``local`` group has no process group.
        """
        if self.is_local:
            raise RuntimeError("a local (one-rank) CP group has no torch.distributed process group")
        if self._pg is not None:
            return self._pg
        world = dist.group.WORLD
        if not isinstance(world, dist.ProcessGroup):
            raise RuntimeError("torch.distributed has no default process group")
        return world

    @property
    def host_device(self) -> torch.device:
        """Where this group's small host-read collectives (agreements, checks) put their tensors:
        ``device`` under NCCL, the CPU under Gloo (whose ranks may compute on GPUs, see
        :func:`~cpkv.runtime.launch.run_ranks`'s ``gpus``)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def is_local(self) -> bool:
        """True for the size-1 group of :meth:`single` (no communication at all)."""
        return self.backend == "local"

    # -- collectives --------------------------------------------------------------------------

    def all_gather_rows(self, local: torch.Tensor, max_rows: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather ``local`` (``[n, ...]``, ``n <= max_rows``) from every rank, rank-major.

        Returns a new tensor ``[size * max_rows, ...]`` of ``local``'s dtype on :attr:`device`;
        rank ``r``'s rows are at ``r * max_rows : r * max_rows + n_r``. Rows past ``n_r`` in each
        rank's block are padding with unspecified content; callers never read them.

        One collective (``all_gather_single``) of the raw bytes: the rows are viewed as ``uint8``
        for the transport and back, so every dtype moves unchanged (bf16, fp8, int16, ... which
        Gloo cannot gather natively) and is never widened. No host-device sync; ``n`` and
        ``max_rows`` are host-side shape metadata, identical ``max_rows`` and trailing shape on
        every rank are the caller's contract (rule 16).

        ``out``: a contiguous ``[size * max_rows, ...]`` tensor of ``local``'s dtype (e.g. a slice of
        a larger buffer) to receive into instead of a new one; it is returned.

        Raises:
            ValueError: ``local`` has no row dimension, ``n > max_rows`` or ``max_rows < 0``, or
                ``local`` is not on :attr:`device`, or ``out`` does not fit.
        """
        if local.dim() < 1:
            raise ValueError("all_gather_rows needs a tensor with a row dimension, got a scalar")
        n = local.shape[0]
        if max_rows < 0 or n > max_rows:
            raise ValueError(f"all_gather_rows: {n} rows do not fit max_rows={max_rows}")
        if local.device != self.device:
            raise ValueError(f"all_gather_rows: tensor on {local.device}, group device is {self.device}")
        rest = tuple(local.shape[1:])
        if out is not None and (tuple(out.shape) != (self.size * max_rows, *rest)
                                or out.dtype != local.dtype or not out.is_contiguous()):
            raise ValueError(f"all_gather_rows: out must be a contiguous {local.dtype} tensor of "
                             f"shape {(self.size * max_rows, *rest)}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        if self.is_local:
            if out is None and n == max_rows:
                return local.clone(memory_format=torch.contiguous_format)
            if out is None:
                out = local.new_empty((max_rows, *rest))
            out[:n].copy_(local)
            return out
        row_elems = math.prod(rest)
        if n == max_rows and local.is_contiguous():
            buf = local
        else:
            buf = local.new_empty((max_rows, *rest))
            buf[:n].copy_(local)
        send = buf.view(max_rows, row_elems).view(torch.uint8)  # [max_rows, row_bytes], no copy
        if out is None:
            recv = torch.empty((self.size * max_rows, send.shape[1]), dtype=torch.uint8,
                               device=self.device)
        else:
            recv = out.view(self.size * max_rows, row_elems).view(torch.uint8)
        with waiting_in(f"all_gather_rows (group of {self.size})"):
            _all_gather_single(recv, send, group=self._pg)
        return out if out is not None else recv.view(local.dtype).view(self.size * max_rows, *rest)

    def agree_all(self, local: dict[str, bool]) -> dict[str, bool]:
        """AND of every rank's flags, per key: ``out[k]`` is True iff ``local[k]`` is True on every
        rank. Usable as the plugin registry's ``AgreeFn``.

        One ``all_reduce(MIN)`` over the flags in sorted key order, plus a CRC of the key set (as
        ``+crc`` and ``-crc``, so min and max are both checked), then one host sync.

        Raises:
            ValueError: the ranks passed different key sets (same number of keys; a different
                number of keys is a contract violation the transport may not diagnose).
        """
        keys = sorted(local)
        if self.is_local:
            return {k: bool(local[k]) for k in keys}
        crc = zlib.crc32("\0".join(keys).encode())
        vals = self.agree_min([*(1 if local[k] else 0 for k in keys), crc, -crc])
        if vals[-2] != crc or vals[-1] != -crc:
            raise ValueError(f"agree_all: ranks passed different key sets (rank {self.rank}: {keys})")
        return {k: bool(v) for k, v in zip(keys, vals[:-2], strict=True)}

    def agree_min(self, values: Sequence[int]) -> list[int]:
        """Per position, the minimum over ranks of ``values`` (the same length on every rank;
        pass ``-x`` for a maximum). One ``all_reduce(MIN)`` of int64; one host sync (per request
        at most, never per layer)."""
        if self.is_local:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.host_device)
        with waiting_in(f"agree_min (all_reduce, group of {self.size})"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._pg)
            return [int(v) for v in t.tolist()]

    def all_equal(self, value: str) -> bool:
        """Whether every rank passed the same string (e.g. a plan hash, rule 31's debug check).

        One ``all_gather_object``; every rank gets the same answer.
        """
        if self.is_local:
            return True
        values = self.all_gather_object(str(value))
        return all(v == values[0] for v in values)

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order. One ``all_gather_object``; host sync:
        for setup and error paths, never per layer."""
        if self.is_local:
            return [obj]
        values: list[T | None] = [None] * self.size
        with waiting_in(f"all_gather_object (group of {self.size})"):
            dist.all_gather_object(values, obj, group=self._pg)
        return values  # type: ignore[return-value]  # every slot was filled by the collective

    def check_all(self, ok: bool, message: str) -> None:
        """Collective check: when any rank passes ``ok=False``, every rank raises alike.

        Use before anything is written, e.g. "pool exhausted" on one rank, so that no rank goes
        on to a collective the failing rank will never join.

        One ``all_reduce(MIN)`` of the flag; only when some rank failed, one ``all_gather_object``
        of ``(ok, message)`` (every rank takes the same branch, so the collective order stays
        identical).

        Raises:
            CollectiveCheckError: on every rank, naming each failing rank and its message.
        """
        if self.is_local:
            if not ok:
                raise CollectiveCheckError({0: message}, 1)
            return
        if self.agree_min([1 if ok else 0])[0] == 1:
            return
        gathered = self.all_gather_object((bool(ok), str(message)))
        failures = {r: m for r, (rok, m) in enumerate(gathered) if not rok}
        raise CollectiveCheckError(failures, self.size)

    def barrier(self) -> None:
        """Wait until every rank of the group got here (bounded by :attr:`timeout_s`)."""
        if self.is_local:
            return
        with waiting_in(f"barrier (group of {self.size})"):
            if self.backend == "nccl":
                dist.barrier(group=self._pg, device_ids=[self.device.index or 0])
            else:
                dist.barrier(group=self._pg)
