"""Which GPU a rank computes on: one GPU per rank, or ranks sharing GPUs under Gloo.

NCCL puts one rank on a GPU (two ranks of one communicator on one GPU fail: "duplicate GPU").
A Gloo group moves its collectives' bytes through host memory, so its ranks may compute on
GPUs, several on one: CP2 on one GPU, the CUDA code paths under CP tested while
multi-GPU machines are withheld. :func:`rank_gpu` is that decision, a pure function of the
backend, the rank, the ranks and the GPUs visible; :func:`shared_gpus_line` is the line a
shared placement is announced with (never a silent choice).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuPlacement", "rank_gpu", "shared_gpus_line"]


@dataclass(frozen=True)
class GpuPlacement:
    """Where a rank computes: GPU ``gpu`` of the ``gpus`` visible, one of ``ranks`` ranks."""

    gpu: int
    gpus: int
    ranks: int

    @property
    def shared(self) -> bool:
        """More ranks than GPUs: ranks share GPUs (rank r on GPU r % gpus)."""
        return self.ranks > self.gpus


def rank_gpu(backend: str, rank: int, ranks: int, gpus: int) -> GpuPlacement:
    """The GPU rank ``rank`` of ``ranks`` (the ranks of one host: torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``) computes on with ``gpus`` visible: GPU ``rank`` when there is one per
    rank; under ``gloo`` with fewer, GPU ``rank % gpus`` (ranks share GPUs; Gloo's collectives go
    through host memory).

    Raises:
        ValueError: no GPU, a rank outside ``[0, ranks)``, or ``nccl`` with fewer GPUs than
            ranks (the message names the fix: the gloo backend, or as many ranks as GPUs).
    """
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} outside the {ranks} ranks")
    if gpus < 1:
        raise ValueError(f"{ranks} rank(s) on GPUs, but no GPU is visible")
    if ranks > gpus and backend == "nccl":
        raise ValueError(f"backend 'nccl' puts one rank on a GPU: {ranks} ranks need {ranks} "
                         f"GPUs, {gpus} visible; use the gloo backend (the ranks then share "
                         f"GPUs, rank r on GPU r % {gpus}, collectives through host memory) or "
                         f"{gpus} rank(s)")
    return GpuPlacement(gpu=rank % gpus, gpus=gpus, ranks=ranks)


def shared_gpus_line(place: GpuPlacement) -> str:
    """The announcement of a shared placement (``place.shared``), e.g. for ``cp.size = 2`` on one
    GPU: ``"2 ranks share 1 GPU(s): rank r on GPU r % 1, Gloo collectives through host
    memory"``."""
    return (f"{place.ranks} ranks share {place.gpus} GPU(s): rank r on GPU r % {place.gpus}, "
            f"Gloo collectives through host memory")
