"""Declares the ``torch`` backend (entry point ``cpkv.backends: torch``).

Light on purpose: importing this module imports neither torch nor the ops.
"""

from __future__ import annotations

import importlib.util

from cpkv.contracts import Availability, KVOps, Op
from cpkv.plugin import BackendRegistrar, BackendSpec, hookimpl

NAME = "torch"

#: the ops :class:`~cpkv_backend_torch.ops.TorchOps` implements (one method each)
OPS: frozenset[Op] = frozenset({Op.PAGE_GATHER, Op.PAGE_SCATTER, Op.PAGE_COPY, Op.RERANGE,
                                Op.FP8_PACK,
                                Op.FP8_UNPACK, Op.PEER_GATHER, Op.INDEXER_LOGITS,
                                Op.INDEXER_LOGITS_PAGED, Op.INDEXER_LOGITS_INDEX_PAGES, Op.TOPK,
                                Op.INDEXER_TOPK,
                                Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED, Op.ROPE,
                                Op.INDEX_Q_FP8, Op.PAGE_ROWS, Op.FP8_STORE, Op.RMS_NORM,
                                Op.V4_COMPRESS, Op.V4_INDEX_SCORES, Op.V4_TOPK, Op.V4_INDEX_TOPK,
                                Op.V4_ATTENTION})


def probe() -> Availability:
    """Available wherever torch is importable (CPU or GPU); nothing else is needed."""
    if importlib.util.find_spec("torch") is None:
        return Availability.no("torch is not installed")
    return Availability.yes()


def load() -> KVOps:
    """Import the ops now (not at discovery) and return the backend object."""
    from .ops import TorchOps

    return TorchOps()


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=OPS, probe=probe, load=load,
                              description="reference backend (CPU and GPU)"))
