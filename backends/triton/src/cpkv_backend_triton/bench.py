"""Micro-benchmark of the Triton KV kernels against the torch reference and a plain copy.

``bench_kv("cuda")`` on the H200; ``bench_kv("cpu", small=True)`` runs the same code at tiny sizes
under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is imported), as a smoke
test. Each row: ``name``, ``bytes_moved`` (read + write), ``triton_ms``, ``torch_ms``, ``copy_ms``
(``dst.copy_(src)`` of the same bytes: the ceiling), ``triton_gbps``, ``copy_gbps``,
``ratio_vs_copy`` (triton bandwidth / copy bandwidth) and ``speedup_vs_torch``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from cpkv.bench.timing import median_ms

__all__ = ["bench_kv"]


def bench_kv(device: str | torch.device = "cuda", *, small: bool = False,
             iters: int = 30, warmup: int = 5, seed: int = 0) -> list[dict[str, Any]]:
    """Time triton vs torch page_gather / page_scatter / rerange and a same-size copy.

    Full size (``small=False``): 64K tokens in 64-token pages (1024 pages) of the DeepSeek-V3.2
    rows (fp8 656 + 132 B, bf16 1152 + 256 B), gathered from / scattered into a pool 4x larger
    in random page order; rerange of 64K rows of 7168 bf16 (the hidden states) and of the KV
    rows. ``small=True``: 256 tokens, 2 iterations, for the interpreter.

    Returns:
        one dict per case (see the module docstring).
    """
    from cpkv.testing.conformance import reference_backend

    from .kv import KVKernels

    dev = torch.device(device)
    if small:
        tokens, hidden, iters, warmup = 256, 64, 2, 1
    else:
        tokens, hidden = 65536, 7168
    iters = max(iters, 2 if small else 20)
    page = 64
    pages = tokens // page
    tri, ref = KVKernels(), reference_backend()
    g = torch.Generator().manual_seed(seed)

    def rand_bytes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(dev)

    rows: list[dict[str, Any]] = []

    def add(name: str, nbytes: int, t_fn: Callable[[], Any], r_fn: Callable[[], Any],
            src: torch.Tensor) -> None:
        dst = torch.empty_like(src)
        tri_ms = median_ms(t_fn, dev, warmup, iters)
        ref_ms = median_ms(r_fn, dev, warmup, iters)
        copy_ms = median_ms(lambda: dst.copy_(src), dev, warmup, iters)
        moved = 2 * nbytes
        rows.append({
            "name": name, "bytes_moved": moved, "triton_ms": tri_ms, "torch_ms": ref_ms,
            "copy_ms": copy_ms, "triton_gbps": moved / tri_ms / 1e6,
            "copy_gbps": moved / copy_ms / 1e6, "ratio_vs_copy": copy_ms / tri_ms,
            "speedup_vs_torch": ref_ms / tri_ms,
        })

    kv_rows = {"fp8 latent 656B": 656, "fp8 index-K 132B": 132,
               "bf16 latent 1152B": 1152, "bf16 index-K 256B": 256}
    for label, row_bytes in kv_rows.items():
        pool = rand_bytes(4 * pages, page * row_bytes).view(-1, row_bytes)  # a pool_buffer view
        pool_pages = pool.view(4 * pages, page, row_bytes)
        index = torch.randperm(4 * pages, generator=g)[:pages].to(dev)
        src = rand_bytes(pages, page, row_bytes)
        nbytes = pages * page * row_bytes
        add(f"page_gather {label} ({pages} pages)", nbytes,
            functools.partial(tri.page_gather, pool_pages, index),
            functools.partial(ref.page_gather, pool_pages, index), src)
        add(f"page_scatter {label} ({pages} pages)", nbytes,
            functools.partial(tri.page_scatter, pool_pages, index, src),
            functools.partial(ref.page_scatter, pool_pages, index, src), src)
        gathered = rand_bytes(tokens + tokens // 8, row_bytes)  # padded rank-major rows
        perm = torch.randperm(gathered.shape[0], generator=g)[:tokens].to(dev)
        add(f"rerange {label} rows ({tokens} rows)", tokens * row_bytes,
            functools.partial(tri.rerange, gathered, perm),
            functools.partial(ref.rerange, gathered, perm), gathered[:tokens])
    hid = torch.randn(tokens + tokens // 8, hidden, generator=g).to(torch.bfloat16).to(dev)
    perm = torch.randperm(hid.shape[0], generator=g)[:tokens].to(dev)
    add(f"rerange hidden {hidden} bf16 ({tokens} rows)", tokens * hidden * 2,
        lambda: tri.rerange(hid, perm), lambda: ref.rerange(hid, perm), hid[:tokens])
    return rows
