"""cpkv's default indexer kernels against DeepGEMM's on the same inputs, one GPU.

Rows (``ratio = value / baseline``; value and baseline are milliseconds, so a ratio above 1
means cpkv is faster):

- ``indexer_fp8_vs_deepgemm_<n>x<t>``: the prefill indexer, DeepSeek-V3.2's fp8 numerics (64
  heads x 128, rotated ue8m0 keys, fp8 queries with their scales in the head weights), the last
  ``n`` rows of a ``t``-token prompt (causal ranges from key 0): DeepGEMM's
  ``fp8_fp4_mqa_logits`` with the pass that gives the op's result (``detail``: the kernel alone)
  over the Triton backend's ``indexer_logits``. ``indexer_fp8_vs_deepgemm``: the geometric mean.
- ``indexer_paged_vs_deepgemm``: a decode step's indexer, 64 requests x 128K keys in 64-token
  pages, on the identical input tensors: DeepGEMM's ``fp8_fp4_paged_mqa_logits`` over the
  Triton backend's ``indexer_logits_index_pages``, both reading DeepGEMM's page-major index
  pages (the decode rank's default ``two_part`` layout, ``decode.layout``); ``detail`` gives
  each one's GB/s of index-K read against the same run's copy bandwidth.
  ``indexer_paged_part_major_vs_deepgemm``: the Triton backend's ``indexer_logits_paged`` over
  part-major pool pages holding the same keys (``decode.layout = "part_major"``: 132-byte key
  rows, which DeepGEMM cannot read).

Every pair is checked against each other first (fp8 tolerance, -inf at the same places).
Where DeepGEMM cannot be used the report says why and has no DeepGEMM rows.

Run: ``python -m cpkv_backend_cuda.bench --out FILE`` (``bash benchmarks/gpu.sh OUT deepgemm``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from cpkv.bench.gpu import ceilings
from cpkv.bench.report import BenchReport, BenchRow, machine_description
from cpkv.bench.timing import device_ms
from cpkv.contracts import KVDtype, KVFormat
from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q
from cpkv.plugin import PluginHost

__all__ = ["PREFILL_SHAPES", "bench_deepgemm"]

#: (query rows, keys) of the prefill rows: the issue's shapes
PREFILL_SHAPES: tuple[tuple[int, int], ...] = ((1024, 32768), (4096, 131072), (8192, 65536),
                                               (2048, 524288))
HEADS, DIM = 64, 128


def _triton() -> Any:
    host = PluginHost()
    try:
        return host.backends().load("triton")
    finally:
        host.close()


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference over the largest finite logit; inf when -inf differs."""
    if not torch.equal(a.isneginf(), b.isneginf()):
        return math.inf
    fin = b.isfinite()
    return float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-30))


def _fp8_inputs(n: int, t: int, dev: torch.device, g: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q = hadamard_rotate(torch.randn(n, HEADS, DIM, dtype=torch.bfloat16, device=dev,
                                    generator=g))
    w = torch.randn(n, HEADS, device=dev, generator=g) * (HEADS ** -0.5 * DIM ** -0.5)
    k = hadamard_rotate(torch.randn(t, DIM, dtype=torch.bfloat16, device=dev, generator=g))
    k8, scale = quantize_fp8(k, None, "ue8m0")
    q8, w8 = quantize_index_q(q, w)
    return q8, w8, k8, scale


def _prefill_one(dg: Any, tri: Any, n: int, t: int, dev: torch.device, g: torch.Generator,
                 ceil: dict[str, float], detail: dict[str, Any]) -> BenchRow:
    q8, w8, k8, scale = _fp8_inputs(n, t, dev, g)
    ks = torch.zeros(n, dtype=torch.int64, device=dev)
    ke = torch.arange(t - n + 1, t + 1, dtype=torch.int64, device=dev)
    flops = 2 * HEADS * DIM * float((ke - ks).sum())
    err = _close(dg.indexer_logits(q8, w8, k8, scale, ks, ke),
                 tri.indexer_logits(q8, w8, k8, scale, ks, ke))
    torch.cuda.empty_cache()
    t_tri = device_ms(lambda: tri.indexer_logits(q8, w8, k8, scale, ks, ke), iters=10)
    t_dg = device_ms(lambda: dg.indexer_logits(q8, w8, k8, scale, ks, ke), iters=10)
    t_kernel = device_ms(lambda: dg.compressed_logits(q8, w8, k8, scale, ks, ke), iters=10)
    tag = f"{n // 1024}kx{t // 1024}k"
    detail[f"prefill_{tag}"] = {
        "rows": n, "keys": t, "causal_flops": flops, "triton_ms": t_tri,
        "deepgemm_op_ms": t_dg, "deepgemm_kernel_ms": t_kernel,
        "triton_tflops": flops / t_tri / 1e9, "deepgemm_op_tflops": flops / t_dg / 1e9,
        "deepgemm_kernel_tflops": flops / t_kernel / 1e9,
        "fp8_ceiling_tflops": ceil.get("fp8_matmul_tflops"),
        "max_rel_diff_deepgemm_vs_triton": err}
    return BenchRow.of(f"indexer_fp8_vs_deepgemm_{tag}", t_dg, "ms",
                       "cpkv's default (Triton) fp8 indexer, same inputs (ms)", t_tri)


def prefill_rows(dg: Any, tri: Any, dev: torch.device, ceil: dict[str, float],
                 detail: dict[str, Any], shapes: tuple[tuple[int, int], ...] = PREFILL_SHAPES
                 ) -> list[BenchRow]:
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for n, t in shapes:
        rows.append(_prefill_one(dg, tri, n, t, dev, g, ceil, detail))
        torch.cuda.empty_cache()
    ratios = [r.ratio for r in rows]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    rows.append(BenchRow.of("indexer_fp8_vs_deepgemm", geo, "x",
                            "geometric mean over the shapes (1 = level)", 1.0))
    return rows


def paged_rows(dg: Any, tri: Any, dev: torch.device, ceil: dict[str, float],
               detail: dict[str, Any], requests: int = 64, keys: int = 131072) -> list[BenchRow]:
    from .deepgemm import part_major_index_pages

    fmt = KVFormat.deepseek_v32(KVDtype.FP8)
    ps = fmt.page_size
    m = keys // ps
    g = torch.Generator(device=dev).manual_seed(2)
    pool_pages = requests * m + 16
    # part-major pages: random latent bytes, index-K = rotated ue8m0 keys + scales
    pages = torch.randint(0, 255, (pool_pages, ps, fmt.bytes_per_token), dtype=torch.uint8,
                          device=dev, generator=g)
    k = hadamard_rotate(torch.randn(pool_pages * ps, DIM, dtype=torch.bfloat16, device=dev,
                                    generator=g))
    k8, scale = quantize_fp8(k, None, "ue8m0")
    del k
    nl = fmt.latent_bytes_per_token
    idx = torch.cat([k8.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], 1)
    flat = pages.view(pool_pages, -1)
    flat[:, ps * nl:] = idx.view(pool_pages, -1)
    del idx, k8, scale
    dgp = part_major_index_pages(pages, nl)
    table = torch.randperm(pool_pages, device=dev, generator=g)[:requests * m]
    table = table.view(requests, m).to(torch.int32)
    row_request = torch.arange(requests, dtype=torch.int32, device=dev)
    key_end = torch.randint(keys - 4096, keys + 1, (requests,), device=dev, generator=g)
    q = hadamard_rotate(torch.randn(requests, HEADS, DIM, dtype=torch.bfloat16, device=dev,
                                    generator=g))
    w = torch.randn(requests, HEADS, device=dev, generator=g) * (HEADS ** -0.5 * DIM ** -0.5)
    q8, w8 = quantize_index_q(q, w)

    def cpkv_step() -> torch.Tensor:
        out: torch.Tensor = tri.indexer_logits_paged(q8, w8, pages, fmt, table, row_request,
                                                     key_end)
        return out

    def dg_step() -> torch.Tensor:
        out: torch.Tensor = dg.indexer_logits_index_pages(q8, w8, dgp, fmt, table, row_request,
                                                          key_end)
        return out

    def cpkv_major_step() -> torch.Tensor:
        out: torch.Tensor = tri.indexer_logits_index_pages(q8, w8, dgp, fmt, table, row_request,
                                                           key_end)
        return out

    err = _close(dg_step(), cpkv_step())
    err_major = _close(dg_step(), cpkv_major_step())
    t_tri = device_ms(cpkv_step, iters=20)
    t_major = device_ms(cpkv_major_step, iters=20)
    t_dg = device_ms(dg_step, iters=20)
    nbytes = float(key_end.sum()) * (DIM + 4)
    detail["paged_64x128k"] = {
        "requests": requests, "keys": keys, "index_bytes_read": nbytes, "triton_ms": t_tri,
        "deepgemm_ms": t_dg, "triton_gbps": nbytes / t_tri / 1e6,
        "deepgemm_gbps": nbytes / t_dg / 1e6, "copy_gbps": ceil["copy_gbps"],
        "max_rel_diff_deepgemm_vs_triton": err, "triton_page_major_ms": t_major,
        "triton_page_major_gbps": nbytes / t_major / 1e6,
        "max_rel_diff_deepgemm_vs_triton_page_major": err_major}
    return [BenchRow.of("indexer_paged_vs_deepgemm", t_dg, "ms",
                        "cpkv's default (Triton) decode indexer on the same page-major tensors "
                        "(ms)", t_major),
            BenchRow.of("indexer_paged_part_major_vs_deepgemm", t_dg, "ms",
                        "cpkv's (Triton) paged indexer over part-major pool pages, same keys "
                        "(ms)", t_tri)]


def bench_deepgemm(shapes: tuple[tuple[int, int], ...] = PREFILL_SHAPES) -> BenchReport:
    """The rows above on ``cuda:0``; without DeepGEMM, no rows and ``detail.deepgemm`` says
    why."""
    from .plugin import deepgemm_ops

    dev = torch.device("cuda", 0)
    detail: dict[str, Any] = {}
    rows: list[BenchRow] = []
    try:
        dg = deepgemm_ops()
    except RuntimeError as exc:
        detail["deepgemm"] = f"absent: {exc}"
    else:
        detail["deepgemm"] = "present"
        ceil = ceilings(dev)
        detail["ceilings"] = ceil
        tri = _triton()
        rows += prefill_rows(dg, tri, dev, ceil, detail, shapes)
        rows += paged_rows(dg, tri, dev, ceil, detail)
    return BenchReport(machine=machine_description(), command="python -m cpkv_backend_cuda.bench",
                       results=tuple(rows), detail=detail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(f"{n}x{t}" for n, t in PREFILL_SHAPES),
                    help="prefill shapes, rows x keys, comma-separated")
    args = ap.parse_args()
    shapes = tuple((int(a), int(b)) for a, b in (s.split("x") for s in args.shapes.split(",")))
    rep = bench_deepgemm(shapes)
    rep.write(args.out)
    for r in rep.results:
        print(f"{r.name:44s} {r.value:10.3f} {r.unit:3s} vs {r.baseline_value:10.3f}  "
              f"ratio {r.ratio:.3f}")
    for key, val in rep.detail.items():
        print(key, val)


if __name__ == "__main__":
    main()
