"""Per-rank setup: resolve ops (all ranks agree), check the configuration, create the pool.

Startup checks run before any rank allocates KV, and reject combinations that cannot work with
one error listing every problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cpkv.comm import rank_gpu, shared_gpus_line
from cpkv.contracts import KVFormat, Op, SplitMode, layer_formats
from cpkv.kv import ShardedKVPool
from cpkv.logs import get_logger
from cpkv.ops import KV_OPS, OpTable
from cpkv.plugin import PluginHost, Registry

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.settings import Settings

__all__ = ["MATERIALIZE_PATHS", "StartupError", "check_startup", "create_pool",
           "has_fp8_tensor_cores", "resolve_ops"]

log = get_logger(__name__)

#: split modes whose pages have a materialization path (and a PD transfer) in this release
MATERIALIZE_PATHS: frozenset[SplitMode] = frozenset({SplitMode.ZIGZAG, SplitMode.INTERLEAVE})


class StartupError(ValueError):
    """The settings describe a combination that cannot run; nothing was allocated."""


def resolve_ops(settings: Settings, group: CPGroup, host: PluginHost | None = None,
                ops: Sequence[Op] = KV_OPS) -> tuple[OpTable, Registry]:
    """Pick a backend per op in the settings' preference order, agreed across ranks."""
    own = host is None
    host = host or PluginHost(disable=settings.plugins.disable, allow=settings.plugins.allow)
    try:
        registry = host.backends()
        return OpTable.resolve(registry, settings.backend.effective_preference(), ops,
                               agree=group.agree_all, device_type=group.device.type,
                               quiet=settings.backend.name == "auto"), registry
    finally:
        if own:
            host.close()


def check_startup(settings: Settings, fmt: KVFormat, group: CPGroup, ops: OpTable,
                  registry: Registry) -> None:
    """Reject settings that cannot work, before any rank allocates.

    Raises:
        StartupError: listing every problem found.
    """
    problems: list[str] = []
    if settings.cp.mode not in MATERIALIZE_PATHS:
        problems.append(f"cp.mode={settings.cp.mode.value!r} has no materialization path "
                        f"(supported: {sorted(m.value for m in MATERIALIZE_PATHS)})")
    if settings.cp.size != group.size:
        problems.append(f"cp.size={settings.cp.size} but the CP group has {group.size} ranks")
    if fmt.page_size != settings.kv.page_size:
        problems.append(f"kv.page_size={settings.kv.page_size} but the format has "
                        f"{fmt.page_size}-token pages")
    # "auto" as the group's device resolves it (a session passes resolved settings)
    want = settings.resolved(has_fp8_tensor_cores(group.device)).kv.dtype
    if fmt.dtype != want:
        problems.append(f"kv.dtype={settings.kv.dtype} but the format is {fmt.dtype.value}")
    for op, name in sorted(ops.chosen.items()):
        sizes = getattr(registry.specs.get(name), "page_sizes", None)
        if sizes is not None and fmt.page_size not in sizes:
            problems.append(f"backend {name!r} ({op}) supports page sizes {sorted(sizes)}, not "
                            f"kv.page_size={fmt.page_size}")
    if group.device.type == "cuda" and not group.is_local:
        try:  # NCCL: a GPU per rank; Gloo: ranks may share GPUs (announced, not silent)
            place = rank_gpu(group.backend, group.rank, group.size, torch.cuda.device_count())
        except ValueError as exc:
            problems.append(f"cp.size={group.size}: {exc}")
        else:
            if place.shared and group.rank == 0:
                log.warning("cpkv.gpu.shared", ranks=place.ranks, gpus=place.gpus,
                            line=shared_gpus_line(place))
    if problems:
        raise StartupError("cannot start: " + "; ".join(problems))


def has_fp8_tensor_cores(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies fp8 (e4m3) on tensor cores: CUDA compute capability 8.9
    (Ada) or later (Hopper, Blackwell); never a CPU. What ``"auto"`` numeric settings are
    resolved by (:meth:`cpkv.settings.Settings.resolved`)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 9)


def create_pool(settings: Settings, fmt: KVFormat | Sequence[KVFormat], num_layers: int,
                group: CPGroup, host: PluginHost | None = None,
                ops: Sequence[Op] = KV_OPS) -> ShardedKVPool:
    """Resolve ops, run the startup checks, then allocate this rank's pool (sharded or replica;
    ``fmt``: one format for every layer, or one per layer: GLM-5's shared-indexer layers store
    their latent only).

    Raises:
        StartupError: the settings cannot work (raised on every rank alike, before allocation).
        LookupError: no backend provides a needed op.
    """
    table, registry = resolve_ops(settings, group, host, ops)
    fmts = layer_formats(fmt, num_layers)
    check_startup(settings, next((f for f in fmts if f.index_k), fmts[0]), group, table, registry)
    # same memory per rank either way: a replica fits C times fewer tokens in it
    return ShardedKVPool(fmts, num_layers, group, table, shared=settings.kv.shared,
                         pages_per_rank=settings.kv.pages_per_rank, debug=settings.debug,
                         materialize=settings.kv.materialize, layout=settings.kv.layout)
