"""GPU exploration behind docs/perf.md (one GPU; not the headline bench: `cpkv bench gpu`).

Usage: python benchmarks/gpu_explore.py [--out-dir DIR] SECTION [SECTION ...]

Sections: fp8diag (fp8_unpack vs the reference at 64K tokens: every mismatch listed),
kv (gather / scatter / copy: eager vs device time), mla (sparse MLA launch configurations,
MLA_WIDE=1 for the wide variants), kvtune (the copy kernels' launch shape). One JSON object per
line, printed and written to ``DIR/explore_<section>.jsonl``; DIR defaults to ``$BENCH_OUT``, else
``benchmarks/results``. Materialization in both modes, with its parts timed: `cpkv bench gpu`
(detail).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import IO

import torch

from cpkv.bench.timing import device_ms, median_ms

#: the open output file of the running section (rows are printed as well)
_sink: IO[str] | None = None


def emit(**row):
    line = json.dumps(row)
    print(line, flush=True)
    if _sink is not None:
        _sink.write(line + "\n")
        _sink.flush()


def fp8diag() -> None:
    from cpkv.contracts import KVFormat
    from cpkv_backend_torch.ops import TorchOps
    from cpkv_backend_triton.ops import TritonOps

    ds = KVFormat.deepseek_v32("fp8")
    tri, ref = TritonOps(), TorchOps()
    for tokens in (1024, 65536):
        g = torch.Generator().manual_seed(tokens)
        for part in ("latent", "index_k"):
            d = 576 if part == "latent" else 128
            x = (torch.randn(tokens, d, generator=g) * torch.pow(
                10.0, torch.empty(tokens, 1).uniform_(-6, 6, generator=g))).cuda()
            for dt in (torch.float32, torch.bfloat16):
                packed = tri.fp8_pack(x.to(dt), ds, part)
                same_pack = torch.equal(packed, ref.fp8_pack(x.to(dt), ds, part))
                for out in (torch.float32, torch.bfloat16):
                    a = tri.fp8_unpack(packed, ds, part, out)
                    b = ref.fp8_unpack(packed, ds, part, out)
                    bad = a.view(torch.uint8) != b.view(torch.uint8)
                    ne = (a != b) & ~(a.isnan() & b.isnan())
                    rows, cols = ne.nonzero(as_tuple=True)
                    ex = []
                    for r, c in list(zip(rows.tolist(), cols.tolist(), strict=True))[:6]:
                        blk = c // 128 if part == "latent" else 0
                        dims = 512 if part == "latent" else 128
                        code = int(packed[r, c]) if c < dims else None
                        sc = packed[r, dims + 4 * blk: dims + 4 * blk + 4].view(torch.float32)
                        ex.append({"row": r, "col": c, "code": code, "scale": float(sc),
                                   "tri": float(a[r, c]), "ref": float(b[r, c]),
                                   "x": float(x[r, c])})
                    emit(sec="fp8diag", tokens=tokens, part=part, src=str(dt), out=str(out),
                         same_pack=same_pack, bad_bytes=int(bad.sum()), bad_vals=int(ne.sum()),
                         examples=ex)


def kv() -> None:
    from cpkv.contracts import KVFormat
    from cpkv_backend_torch.ops import TorchOps
    from cpkv_backend_triton.ops import TritonOps

    tri, ref = TritonOps(), TorchOps()
    dev = torch.device("cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    emit(sec="kv", name="copy 1GiB", eager_gbps=2 * big.numel() / median_ms(lambda: big2.copy_(big)) / 1e6,
         device_gbps=2 * big.numel() / device_ms(lambda: big2.copy_(big)) / 1e6)
    fmt = KVFormat.deepseek_v32("fp8")
    for b in (fmt.bytes_per_token, 656, 132):
        pool = torch.randint(0, 255, (4096, 64, b), dtype=torch.uint8, device=dev)
        idx = torch.randperm(4096, device=dev)[:1024]
        src = torch.randint(0, 255, (1024, 64, b), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        nb = 2 * src.numel()
        rows = pool.view(-1, b)
        perm = torch.randperm(rows.shape[0], device=dev)[:65536]
        cases = {"copy": lambda d=dst, s=src: d.copy_(s),
                 "tri_gather": lambda p=pool, i=idx: tri.page_gather(p, i),
                 "ref_gather": lambda p=pool, i=idx: ref.page_gather(p, i),
                 "tri_scatter": lambda p=pool, i=idx, s=src: tri.page_scatter(p, i, s),
                 "ref_scatter": lambda p=pool, i=idx, s=src: ref.page_scatter(p, i, s),
                 "tri_rows": lambda r=rows, i=perm: tri.page_gather(r, i),
                 "ref_rows": lambda r=rows, i=perm: ref.page_gather(r, i)}
        for name, fn in cases.items():
            emit(sec="kv", row_bytes=b, name=name, eager_gbps=nb / median_ms(fn) / 1e6,
                 device_gbps=nb / device_ms(fn) / 1e6)


def mla() -> None:
    from cpkv_backend_triton.attention import MLA_LOWP_DEFAULT, AttentionKernels

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, h, kk, t = 1024, 128, 2048, 65536
    q = torch.randn(n, h, 576, dtype=torch.bfloat16, device=dev, generator=g)
    kvt = torch.randn(t, 576, dtype=torch.bfloat16, device=dev, generator=g)
    ind = torch.randint(0, t, (n, kk), dtype=torch.int32, device=dev, generator=g)
    # neighbours share keys, as in a prefill: rows of a 64-row block pick from one 16K window
    ind_local = (torch.randint(0, 16384, (n, kk), dtype=torch.int32, device=dev, generator=g)
                 + (torch.arange(n, device=dev, dtype=torch.int32)[:, None] // 64) * 2048) % t
    flops = 2.0 * n * h * kk * (576 + 512)
    base = AttentionKernels(mla_config=dict(MLA_LOWP_DEFAULT)).sparse_mla(q, kvt, ind, 576 ** -0.5, 512)
    variants = []
    if os.environ.get("MLA_WIDE"):  # more warps per program, or all 128 heads in one program
        for bh, bk, nw, ns in ((64, 64, 16, 2), (64, 64, 16, 3), (64, 32, 16, 3),
                               (128, 64, 16, 2), (128, 32, 16, 2), (128, 32, 16, 3),
                               (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)):
            variants.append({"HEADS_FAST": 1, "BLOCK_H": bh, "BLOCK_K": bk, "num_warps": nw,
                             "num_stages": ns})
    else:
        for hf in (0, 1):
            for bk in (32, 64):
                for nw in (4, 8):
                    for ns in (1, 2, 3):
                        variants.append({"HEADS_FAST": hf, "BLOCK_K": bk, "num_warps": nw,
                                         "num_stages": ns})
    for v in variants:
        cfg = {**MLA_LOWP_DEFAULT, **v}
        ker = AttentionKernels(mla_config=cfg)
        try:
            out = ker.sparse_mla(q, kvt, ind, 576 ** -0.5, 512)
            diff = float((out - base).abs().max())
            ms = device_ms(lambda k=ker: k.sparse_mla(q, kvt, ind, 576 ** -0.5, 512), iters=10)
            ms_loc = device_ms(lambda k=ker: k.sparse_mla(q, kvt, ind_local, 576 ** -0.5, 512),
                               iters=10)
        except Exception as exc:  # out of resources etc.
            emit(sec="mla", cfg=v, error=repr(exc)[:200])
            continue
        emit(sec="mla", cfg=v, tflops=flops / ms / 1e9, tflops_local=flops / ms_loc / 1e9,
             diff_vs_default=diff)


def kvtune() -> None:
    """Launch shapes of the row-copy kernel on the 788-B page gather and the 788-B row gather."""
    from cpkv_backend_torch.ops import TorchOps
    from cpkv_backend_triton import kv as kvmod
    from cpkv_backend_triton.ops import TritonOps

    tri, ref = TritonOps(), TorchOps()
    dev = torch.device("cuda")
    pool = torch.randint(0, 255, (4096, 64, 788), dtype=torch.uint8, device=dev)
    idx = torch.randperm(4096, device=dev)[:1024]
    src = torch.randint(0, 255, (1024, 64, 788), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    rows = pool.view(-1, 788)
    perm = torch.randperm(rows.shape[0], device=dev)[:65536]
    nb = 2 * src.numel()
    emit(sec="kvtune", name="copy", gbps=nb / device_ms(lambda: dst.copy_(src)) / 1e6,
         ref_gather=nb / device_ms(lambda: ref.page_gather(pool, idx)) / 1e6)
    keep = dict(kvmod.COPY_TUNE)
    for pb in (8192, 16384, 32768, 65536):
        for cb in (2048, 4096, 8192, 16384):
            for nw in (None, 4, 8, 16):
                if cb > pb:
                    continue
                kvmod.COPY_TUNE.update(program_bytes=pb, col_bytes=cb, num_warps=nw)
                r = {k: nb / device_ms(fn) / 1e6 for k, fn in {
                    "gather": lambda: tri.page_gather(pool, idx),
                    "scatter": lambda: tri.page_scatter(pool, idx, src),
                    "rows": lambda: tri.page_gather(rows, perm)}.items()}
                emit(sec="kvtune", program_bytes=pb, col_bytes=cb, num_warps=nw, **r)
    kvmod.COPY_TUNE.update(keep)


SECTIONS = {"fp8diag": fp8diag, "kv": kv, "mla": mla, "kvtune": kvtune}


def main() -> None:
    global _sink
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sections", nargs="+", choices=sorted(SECTIONS))
    ap.add_argument("--out-dir", type=Path,
                    default=Path(os.environ.get("BENCH_OUT") or "benchmarks/results"),
                    help="where explore_<section>.jsonl go (default: $BENCH_OUT, else "
                         "benchmarks/results)")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for sec in args.sections:
        with open(args.out_dir / f"explore_{sec}.jsonl", "w", encoding="utf-8") as f:
            _sink = f
            try:
                SECTIONS[sec]()
            except Exception as exc:
                import traceback
                traceback.print_exc()
                emit(sec=sec, error=repr(exc)[:500])
        _sink = None


if __name__ == "__main__":
    main()
