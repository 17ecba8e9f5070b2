"""Run a job's rank function in a world that an outside launcher started (``torchrun``).

:func:`~cpkv.runtime.launch.run_ranks` spawns the ranks of one machine itself. When ``torchrun``
(or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) starts
the processes instead, each process is already one rank: :func:`run_in_world` joins the process
group from the environment, runs the rank function, and hands every rank the list of all ranks'
results (one ``all_gather_object``), so rank 0 can build the same report ``run_ranks`` would have
given it. The same job then spans nodes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpkv.comm import CPGroup
from cpkv.fallback import recording

from .launch import CHILD_ENV_DEFAULTS, RankResult

__all__ = ["launched_world", "run_in_world"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world() -> tuple[int, int] | None:
    """``(rank, world size)`` when a launcher started this process as one rank of a world, else
    None.

    Raises:
        ValueError: the launcher's variables are only partly set, or not integers.
    """
    present = [k for k in _ENV if k in os.environ]
    if not present:
        return None
    if len(present) != len(_ENV):
        missing = [k for k in _ENV if k not in os.environ]
        raise ValueError(f"launcher environment incomplete: {', '.join(present)} set but "
                         f"{', '.join(missing)} not (torchrun sets all of them)")
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError as exc:
        raise ValueError(f"RANK / WORLD_SIZE must be integers: {exc}") from exc


def run_in_world(fn: Callable[..., Any], *, args: Sequence[Any] = (), device: str = "cpu",
                 timeout_s: float = 120.0, fallback_policy: str = "warn") -> list[RankResult]:
    """Join the launcher's world (Gloo on CPUs; NCCL with ``device="cuda"``, this rank on
    ``cuda:LOCAL_RANK``), run ``fn(group, *args)`` and return every rank's :class:`RankResult`,
    in rank order, on every rank. An exception in ``fn`` propagates (the launcher stops the other
    ranks).

    Raises:
        ValueError: this process was not started by a launcher (see :func:`launched_world`).
    """
    world = launched_world()
    if world is None:
        raise ValueError("not started by torchrun: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT "
                         "are not set")
    rank, size = world
    for key, value in CHILD_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    backend, dev = "gloo", torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if device == "cuda":
        backend = "nccl"
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    try:
        group = CPGroup(rank=rank, size=size, backend=backend,  # type: ignore[arg-type]
                        device=dev, timeout_s=timeout_s)
        t0 = time.perf_counter()
        with recording(fallback_policy) as rec:
            value = fn(group, *args)
        mine = RankResult(rank=rank, value=value, fallbacks=list(rec.events),
                          seconds=time.perf_counter() - t0)
        return group.all_gather_object(mine)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
