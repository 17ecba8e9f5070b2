"""Host tier benchmark: :class:`~cpkv.kv.host.HostPages` reload and save bandwidth.

Stored format: DeepSeek-V3.2 fp8 (64-token pages, latent + index-K, 788 B per token per layer).
``pages`` pages of every layer move between host slots in random order and random distinct
device slots of a pool twice that size (scattered on both sides, as after many evictions):

* ``host_reload``: :meth:`HostPages.load` of every layer (host -> device), GB/s; ceiling: one
  contiguous pinned host -> device ``copy_(non_blocking=True)`` of the same bytes.
* ``host_save``: :meth:`HostPages.save` of the same pages (device -> host), GB/s; ceiling: one
  contiguous device -> pinned host copy of the same bytes.

Bytes = pages x page bytes x layers. Timed with :func:`~cpkv.bench.timing.median_ms` (CUDA events
on a GPU, ``perf_counter`` on a CPU, where "pinned" is plain host memory). A round trip (save,
zero the device slots, load) must give back the device bytes exactly (``detail["bit_exact"]``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from cpkv.contracts import KVDtype, KVFormat, Op
from cpkv.kv.host import HostPages
from cpkv.ops import OpTable
from cpkv.plugin import PluginHost

from .report import BenchRow
from .timing import median_ms

__all__ = ["FMT", "RoundTripError", "run"]

#: DeepSeek-V3.2's fp8 stored format
FMT = KVFormat(dtype=KVDtype.FP8, page_size=64, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
               quant_block=128)


class RoundTripError(RuntimeError):
    """The pages loaded back from the host differ from the saved ones."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ops(device: torch.device) -> OpTable:
    host = PluginHost()
    try:
        pref = ["triton", "torch"] if device.type == "cuda" else ["torch"]
        return OpTable.resolve(host.backends(), pref, (Op.PAGE_COPY,))
    finally:
        host.close()


def run(device: torch.device, pages: int, layers: int,
        progress: Callable[[str], None] = lambda s: None, *, seed: int = 0,
        ) -> tuple[list[BenchRow], dict[str, Any]]:
    """Measure reload and save on ``device``. Returns the rows ``host_reload`` and ``host_save``
    and the detail (format, sizes, milliseconds, ``bit_exact``).

    Raises:
        RoundTripError: the round trip did not give back the saved bytes.
    """
    if pages < 1 or layers < 1:
        raise ValueError(f"pages and layers must be >= 1, got {pages} and {layers}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    fmt = FMT
    ps, width = fmt.page_size, fmt.bytes_per_token
    nbytes = pages * fmt.page_bytes * layers
    ops = _ops(device)
    progress(f"{pages} pages x {layers} layers of {fmt.page_bytes} B ({nbytes / 1e6:.1f} MB) "
             f"on {device}")

    rng = random.Random(seed)
    dev_capacity = 2 * pages
    host_slots = rng.sample(range(pages), pages)
    dev_slots = rng.sample(range(dev_capacity), pages)
    dev_idx = torch.tensor(dev_slots, dtype=torch.int64, device=device)
    gen = torch.Generator(device).manual_seed(seed)
    dev_kv = [torch.empty(dev_capacity, ps, width, dtype=torch.uint8, device=device)
              .random_(0, 256, generator=gen) for _ in range(layers)]
    host = HostPages(fmt, layers, pages, 1, device)
    hs_dev = host.index(host_slots)

    # round trip: save, zero the device slots, load back; every byte must come back
    progress("round trip (bit exactness)")
    before = [b.clone() for b in dev_kv]
    host.save(dev_kv, dev_idx, hs_dev, ops)
    _sync(device)
    hs_idx = torch.tensor(host_slots, dtype=torch.int64)
    bit_exact = all(torch.equal(host.kv[layer].index_select(0, hs_idx),
                                before[layer].index_select(0, dev_idx).cpu())
                    for layer in range(layers))
    for b in dev_kv:
        b.index_fill_(0, dev_idx, 0)
    for layer in range(layers):
        host.load(layer, dev_kv[layer], hs_dev, dev_idx, ops)
    _sync(device)
    bit_exact = bit_exact and all(torch.equal(a, b) for a, b in zip(dev_kv, before, strict=True))
    del before
    if not bit_exact:
        raise RoundTripError("host tier round trip is not bit exact: the reloaded device pages "
                             "differ from the saved ones")

    def reload() -> None:
        for layer in range(layers):
            host.load(layer, dev_kv[layer], hs_dev, dev_idx, ops)

    def save() -> None:
        host.save(dev_kv, dev_idx, hs_dev, ops)

    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def h2d() -> None:
        flat_dev.copy_(flat_host, non_blocking=True)

    def d2h() -> None:
        flat_host.copy_(flat_dev, non_blocking=True)

    ms: dict[str, float] = {}
    for name, fn in (("reload", reload), ("pinned_h2d_copy", h2d), ("save", save),
                     ("pinned_d2h_copy", d2h)):
        progress(name)
        ms[name] = median_ms(fn, device)
        _sync(device)

    def gbps(t_ms: float) -> float:
        return nbytes / t_ms / 1e6

    rows = [
        BenchRow.of("host_reload", gbps(ms["reload"]), "GB/s", "pinned_h2d_copy",
                    gbps(ms["pinned_h2d_copy"])),
        BenchRow.of("host_save", gbps(ms["save"]), "GB/s", "pinned_d2h_copy",
                    gbps(ms["pinned_d2h_copy"])),
    ]
    detail: dict[str, Any] = {
        "device": str(device),
        "pinned": cuda,
        "format": fmt.model_dump(mode="json"),
        "bytes_per_token": fmt.bytes_per_token,
        "page_bytes": fmt.page_bytes,
        "pages": pages,
        "layers": layers,
        "bytes": nbytes,
        "device_pool_pages": dev_capacity,
        "ms": ms,
        "ops": dict(ops.chosen),
        "bit_exact": bit_exact,
    }
    return rows, detail
