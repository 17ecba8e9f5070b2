"""Launch configurations of the paged indexer (``indexer_logits_paged``, Triton) in a decode step
of B requests of CTX tokens each (the 2-layer ``v32-attention`` stack, fp8 pool): the op's GPU
time per configuration over the decode pool's pages and the requests' block tables (random
queries and head weights of the model's shapes), against the bytes it must read.

``--pages``: the key-tile kernel against the page-tile kernel (``PAGED_KERNEL`` 1) on both
index-K page orders, the pool's part-major pages (``indexer_logits_paged``) and DeepGEMM's
page-major ones (``indexer_logits_index_pages``, the engines' two_part index-K), and DeepGEMM's
``fp8_fp4_paged_mqa_logits`` on the page-major copy of the same keys, DeepSeek-V3.2's numerics
(64 heads x 128, rotated ue8m0 keys, fp8 queries), B requests of ~CTX keys over a randomly
permuted block table, with the same run's copy bandwidth. Every output is checked against the
key-tile default's (max difference over the largest logit, -inf at the same places).

Decides the ``INDEXER`` tuning row's paged fields (``PAGED_*``).

Command: bash benchmarks/gpu.sh OUT indexer_paged_sweep   (--pages at 64 x 128K; or
         python benchmarks/indexer_paged_sweep_gpu.py [--pages] OUT.json [B] [CTX])
Card: one GPU; DeepGEMM's rows need .dg (gpu.sh builds it).
Writes: OUT.json {ceilings, device, shape: {requests, keys, rows: [{kind, PAGED_*, ms, GBps,
        vs_copy, deepgemm_ms_over_this}]}}; docs/perf.md "Tuning sweeps".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

CONFIGS = [{"PAGED_BLOCK_N": bn, "paged_warps": w, "PAGED_ROWS": r}
           for bn in (64, 128, 256, 512) for w in (4, 8) for r in (1, 2)]


def _inputs(worker: Any, rids: list[Hashable]) -> tuple[Any, ...]:
    """The op's arguments for one step's layer 0: queries and head weights drawn at random, the
    pool's pages, each request's block table (padded to a power of two, as the decoder's)."""
    pool, cfg = worker.pool, worker.decoder.model.config
    dev, b = pool.group.device, len(rids)
    slots = [pool.pages.requests[rid].slots for rid in rids]
    width = 1 << (max(map(len, slots)) - 1).bit_length()
    table = torch.zeros(b, width, dtype=torch.int32)
    for i, s in enumerate(slots):
        table[i, :len(s)] = torch.tensor(s, dtype=torch.int32)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, cfg.index_n_heads, cfg.index_head_dim, generator=g, device=dev,
                    dtype=torch.bfloat16)
    w = torch.rand(b, cfg.index_n_heads, generator=g, device=dev)
    key_end = torch.tensor([pool.pages.requests[rid].valid_len for rid in rids], dtype=torch.int64,
                           device=dev)
    return (q, w, pool.store.kv[0], pool.fmt, table.to(dev),
            torch.arange(b, dtype=torch.int32, device=dev), key_end)


def _sweep(worker: Any, rids: list[Hashable]) -> dict[str, Any]:
    from cpkv.bench.gpu import cuda_ms

    impl = worker.session.ops.indexer_logits_paged.__self__  # Triton's AttentionKernels
    args = _inputs(worker, rids)
    q, _, _, fmt, table, _, key_end = args
    ref = impl.indexer_logits_paged(*args)
    need = int(key_end.sum().item()) * (q.shape[2] + 4)  # fp8 index-K and its fp32 scale a key
    rows = []
    base = dict(impl.indexer_config)
    for cfg in CONFIGS:
        impl.indexer_config = {**base, **cfg}
        try:
            out = impl.indexer_logits_paged(*args)
            same = bool(torch.equal(out, ref))
            ms = cuda_ms(lambda: impl.indexer_logits_paged(*args))
            rows.append({**cfg, "ms": ms, "GBps": need / ms / 1e6, "equal": same})
        except Exception as exc:  # a configuration out of resources: say so, go on
            rows.append({**cfg, "error": repr(exc)[:200]})
    impl.indexer_config = base
    return {"rows": len(rids), "q": str(q.dtype), "heads": q.shape[1], "dim": q.shape[2],
            "table_width": table.shape[1], "page_size": fmt.page_size, "key_bytes": need,
            "default": {k: base[k] for k in CONFIGS[0]}, "configs": rows}


#: the page-tile kernel's configurations (both page orders): pages a program, pipeline depth,
#: warps, the dot's orientation
PAGE_CONFIGS = [{"PAGED_KERNEL": 1, "PAGED_PAGES": p, "PAGED_STAGES": st, "paged_warps": w,
                 "PAGED_KEYS_M": km}
                for p, st, w, km in [
                    *((p, st, 4, 1) for p in (2, 4, 8, 16) for st in (1, 3)),
                    *((p, st, 8, 1) for p in (8, 16) for st in (1, 3)),
                    (1, 1, 4, 0), (4, 1, 4, 0)]]
#: the key-tile kernel's (the default first)
TILE_CONFIGS = [{"PAGED_KERNEL": 0, "PAGED_BLOCK_N": bn, "paged_warps": w, "PAGED_ROWS": 1}
                for bn, w in ((128, 4), (64, 4), (256, 8))]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over the largest finite |b|; inf when -inf differs."""
    if not torch.equal(a.isneginf(), b.isneginf()):
        return float("inf")
    fin = b.isfinite()
    return float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-30))


def _page_inputs(requests: int, keys: int, dev: torch.device) -> dict[str, Any]:
    """Part-major fp8 pages (random latent bytes, index-K = rotated ue8m0 keys and scales), their
    page-major copy, a permuted block table, key ends in (keys - 4096, keys], fp8 queries."""
    from cpkv.contracts import KVDtype, KVFormat
    from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q
    from cpkv_backend_cuda.deepgemm import part_major_index_pages

    fmt = KVFormat.deepseek_v32(KVDtype.FP8)
    ps, nl = fmt.page_size, fmt.latent_bytes_per_token
    m = keys // ps
    g = torch.Generator(device=dev).manual_seed(2)
    pool = requests * m + 16
    pages = torch.randint(0, 255, (pool, ps, fmt.bytes_per_token), dtype=torch.uint8,
                          device=dev, generator=g)
    k = hadamard_rotate(torch.randn(pool * ps, 128, dtype=torch.bfloat16, device=dev,
                                    generator=g))
    k8, scale = quantize_fp8(k, None, "ue8m0")
    idx = torch.cat([k8.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], 1)
    pages.view(pool, -1)[:, ps * nl:] = idx.view(pool, -1)
    del k, k8, scale, idx
    table = torch.randperm(pool, device=dev, generator=g)[:requests * m]
    key_end = torch.randint(max(1, keys - 4096), keys + 1, (requests,), device=dev, generator=g)
    q = hadamard_rotate(torch.randn(requests, 64, 128, dtype=torch.bfloat16, device=dev,
                                    generator=g))
    w = torch.randn(requests, 64, device=dev, generator=g) * (64 ** -0.5 * 128 ** -0.5)
    q8, w8 = quantize_index_q(q, w)
    return {"fmt": fmt, "pages": pages, "index_pages": part_major_index_pages(pages, nl),
            "table": table.view(requests, m).to(torch.int32),
            "row_request": torch.arange(requests, dtype=torch.int32, device=dev),
            "key_end": key_end, "q": q8, "w": w8}


def _time(fn: Any, ref: torch.Tensor) -> dict[str, Any]:
    from cpkv.bench.timing import device_ms

    try:
        out = fn()
        err = _diff(out, ref)
        return {"ms": device_ms(fn, iters=20), "max_rel_diff": err}
    except Exception as exc:  # a configuration out of resources: say so, go on
        return {"error": repr(exc)[:200]}


def pages_sweep(requests: int, keys: int) -> dict[str, Any]:
    """The ``--pages`` rows of one shape (module docstring)."""
    from cpkv_backend_triton.attention import AttentionKernels

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    x = _page_inputs(requests, keys, dev)
    fmt, tb, rr, ke, q, w = x["fmt"], x["table"], x["row_request"], x["key_end"], x["q"], x["w"]
    nbytes = float(ke.sum()) * (128 + 4)
    base = AttentionKernels()
    ref = AttentionKernels(indexer_config=TILE_CONFIGS[0]).indexer_logits_paged(
        q, w, x["pages"], fmt, tb, rr, ke)
    rows: list[dict[str, Any]] = []
    try:  # the torch backend's fp32 definition (DeepSeek's numerics, exact fp32 sums)
        from cpkv_backend_torch.ops import TorchOps

        exact = TorchOps().indexer_logits_paged(q, w, x["pages"], fmt, tb, rr, ke)
    except Exception as exc:  # out of memory at a large shape: say so, go on
        exact, exact_note = None, repr(exc)[:200]
    else:
        exact_note = "torch reference"

    def add(kind: str, cfg: dict[str, int], fn: Any) -> None:
        r = {"kind": kind, **cfg, **_time(fn, ref)}
        if exact is not None and "ms" in r:
            r["max_rel_diff_fp32"] = _diff(fn(), exact)
        if "ms" in r:
            r["GBps"] = nbytes / r["ms"] / 1e6
        rows.append(r)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for cfg in TILE_CONFIGS:
        impl = AttentionKernels(indexer_config=cfg)
        add("key_tiles_part_major", cfg,
            lambda impl=impl: impl.indexer_logits_paged(q, w, x["pages"], fmt, tb, rr, ke))
    for cfg in PAGE_CONFIGS:
        impl = AttentionKernels(indexer_config=cfg)
        add("page_tiles_part_major", cfg,
            lambda impl=impl: impl.indexer_logits_paged(q, w, x["pages"], fmt, tb, rr, ke))
        add("page_tiles_page_major", cfg,
            lambda impl=impl: impl.indexer_logits_index_pages(q, w, x["index_pages"], fmt, tb,
                                                              rr, ke))
    dg_note = "present"
    try:
        from cpkv_backend_cuda.plugin import deepgemm_ops

        dg = deepgemm_ops()
    except RuntimeError as exc:
        dg_note = f"absent: {exc}"
    else:
        add("deepgemm_page_major", {},
            lambda: dg.indexer_logits_index_pages(q, w, x["index_pages"], tb, rr, ke))
    return {"requests": requests, "keys": keys, "index_bytes_read": nbytes, "deepgemm": dg_note,
            "fp32_reference": exact_note,
            "table_default": {k: base.indexer_config[k] for k in
                              ("PAGED_KERNEL", "PAGED_PAGES", "PAGED_STAGES", "PAGED_KEYS_M")},
            "rows": rows}


def pages_main(out: Path, requests: int, keys: int) -> None:
    from cpkv.bench.gpu import ceilings

    if torch.cuda.is_available():
        dev = torch.device("cuda", 0)
        res: dict[str, Any] = {"ceilings": ceilings(dev), "device": torch.cuda.get_device_name(dev)}
    else:  # a smoke run of the script (TRITON_INTERPRET=1, tiny shapes): no ceilings
        res = {"ceilings": {"copy_gbps": float("nan")}, "device": "cpu"}
    res["shape"] = pages_sweep(requests, keys)
    copy = res["ceilings"]["copy_gbps"]
    rows = res["shape"]["rows"]
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "ms" in r and (r["kind"] not in best or r["ms"] < best[r["kind"]]["ms"]):
            best[r["kind"]] = r
    res["best"] = best
    dg = best.get("deepgemm_page_major")
    for r in best.values():
        r["vs_copy"] = r["GBps"] / copy
        if dg is not None:
            r["deepgemm_ms_over_this"] = dg["ms"] / r["ms"]
    out.write_text(json.dumps(res, indent=1))
    print(f"{requests} x {keys}: {res['shape']['index_bytes_read'] / 1e9:.3f} GB of index-K; "
          f"copy {copy:.0f} GB/s; DeepGEMM {res['shape']['deepgemm']}")
    for r in sorted(rows, key=lambda r: r.get("ms", 1e9))[:12]:
        cfg = " ".join(f"{k.replace('PAGED_', '').lower()}={v}" for k, v in r.items()
                       if k.startswith("PAGED_") or k == "paged_warps")
        if "ms" in r:
            print(f"  {r['kind']:22s} {cfg:48s} {r['ms']:7.3f} ms {r['GBps']:6.0f} GB/s "
                  f"diff {r['max_rel_diff']:.1e}")
    for r in rows:
        if "error" in r:
            print(f"  {r['kind']} {r}")
    for kind, r in best.items():
        extra = (f", DeepGEMM ms / this {r['deepgemm_ms_over_this']:.3f}"
                 if "deepgemm_ms_over_this" in r else "")
        print(f"best {kind:22s} {r['ms']:.3f} ms, {r['GBps']:.0f} GB/s = {r['vs_copy']:.2f} of "
              f"copy{extra}")


def main() -> None:
    if sys.argv[1] == "--pages":
        pages_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    from cpkv.bench.decode import probe_filled_worker

    out = Path(sys.argv[1])
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
    res = {"ctx": ctx, **probe_filled_worker(_sweep, b, ctx)}
    out.write_text(json.dumps(res, indent=1))
    print(f"{b} x {ctx}: q {res['q']}, {res['key_bytes'] / 1e9:.2f} GB of keys")
    for r in sorted(res["configs"], key=lambda r: r.get("ms", 1e9)):
        cfg = f"BN {r['PAGED_BLOCK_N']:3d} warps {r['paged_warps']} rows {r['PAGED_ROWS']}"
        if "ms" in r:
            print(f"{cfg}  {r['ms']:7.3f} ms  {r['GBps']:7.0f} GB/s  equal {r['equal']}")
        else:
            print(f"{cfg}  {r['error']}")


if __name__ == "__main__":
    main()
