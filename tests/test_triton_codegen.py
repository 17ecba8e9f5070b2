"""What the Triton kernels compile to for Hopper (PTX, built on the CPU: no GPU needed): the paged
indexer reads its gathered fp8 key rows with 4-byte loads, not byte by byte (the decode step's
cost at long contexts: 2.75x from this alone). The compile runs in a fresh interpreter: other test
modules import the kernels under the Triton CPU interpreter, which the compiler cannot take."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from triton_interp import compile_script, needs_bundled_ptxas, ptxas_report

pytest.importorskip("triton")


def _needs_gluon() -> None:
    """Skip without Triton's Gluon, found without importing it here (the compiles run in
    subprocesses)."""
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        pytest.skip("this Triton has no Gluon")


_SCRIPT = r"""
from cpkv_backend_triton.index_views import row_alignment as _row_alignment
from cpkv_backend_triton.kernels.indexer import _indexer_paged_kernel

ptrs = {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
        "bt_ptr": "*i32", "req_ptr": "*i32", "ke_ptr": "*i64", "out_ptr": "*fp32"}
# what the JIT's specialization gives a real launch: 16-byte aligned tensors, the page and
# index-part steps of the DeepSeek fp8 format (50432, 41984) divisible by 16
aligned = [*ptrs, "k_page", "k_first", "s_page"]
kalign = _row_alignment((64 * 788, 64 * 656, 132), 1)
out = {"kalign": kalign}
for label, ka in (("with_hint", kalign), ("without", 1)):
    const = {"H": 64, "HP": 64, "D": 128, "DP": 128, "S": 64, "BQ": 1, "BLOCK_N": 128,
             "FP8": True, "UPCAST": False, "KALIGN": ka}
    ptx = sm90(_indexer_paged_kernel, ptrs, const, aligned, num_warps=4, num_stages=2).asm["ptx"]
    out[label] = {w: len(re.findall(r"ld\.global\." + w + r"\b", ptx)) for w in ("b8", "b32")}
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_paged_indexer_key_loads_are_vectorized() -> None:
    needs_bundled_ptxas()
    res = compile_script(_SCRIPT)
    assert res["kalign"] == 4  # the DeepSeek fp8 pool's key rows start on 4-byte boundaries
    assert res["without"]["b8"] >= 128  # the key tile byte by byte
    assert res["with_hint"]["b8"] == 0 and res["with_hint"]["b32"] >= 32


_PAGES_SCRIPT = r"""
from cpkv_backend_triton.index_views import row_alignment as _row_alignment
from cpkv_backend_triton.kernels.indexer import _indexer_pages_kernel

ptrs = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
        "bt_ptr": "*i32", "req_ptr": "*i32", "ke_ptr": "*i64", "out_ptr": "*fp32"}
# (page step, first, key row, scale page step, scale first, scale row) in elements: the pool's
# part-major DeepSeek fp8 page (132-byte rows) and DeepGEMM's page-major one
layouts = {"part_major": (64 * 788, 64 * 656, 132, 64 * 788 // 4, (64 * 656 + 128) // 4, 33),
           "page_major": (8448, 0, 128, 8448 // 4, 64 * 128 // 4, 1)}
out = {}
for lay, (kp, kf, krow, sp, sf, srow) in layouts.items():
    aligned = [*ptrs, "k_page", "s_page", "sq0", "sq1", "sw0", "sbt0", "so0"]
    aligned += ["k_first", "s_first"] if kf else []
    for stages, km in ((1, 1), (3, 1), (1, 0)):
        const = {"H": 64, "HP": 64, "D": 128, "DP": 128, "S": 64, "KROW": krow, "SROW": srow,
                 "PAGES": 4, "STAGES": stages, "KEYS_M": km, "FP8": True,
                 "UPCAST": False,
                 "KALIGN": _row_alignment((kp, kf), 1), "sq2": 1, "sw1": 1, "sbt1": 1}
        ptx = sm90(_indexer_pages_kernel, ptrs, const, aligned, num_warps=4,
                   num_stages=1).asm["ptx"]
        out[f"{lay}_s{stages}_km{km}"] = {
            "b8": len(re.findall(r"ld\.global(?:\.[\w:]+)*\.b8\s", ptx)),
            "v4": len(re.findall(r"ld\.global(?:\.[\w:]+)*\.v4\.b32\s", ptx)),
            "cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[\w:.]* [^;]*, 0x10", ptx)),
            "bar": len(re.findall(r"bar\.sync", ptx)),
            "shfl": len(re.findall(r"shfl\.sync", ptx))}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_page_tile_indexer_loads_pages_in_wide_pieces() -> None:
    """The page-tile kernel (``_indexer_pages_kernel``): no byte loads in either page order;
    DeepGEMM's page-major keys in 16-byte pieces (``ld.global.v4`` into registers, or
    ``cp.async`` of 16 bytes when the page loop is pipelined); keys @ q^T sums the heads with
    fewer barriers and shuffles than q @ keys^T."""
    needs_bundled_ptxas()
    res = compile_script(_PAGES_SCRIPT)
    assert all(r["b8"] == 0 for r in res.values()), res
    # the queries' 8 KB take 4 v4 loads a thread either way; page-major keys 4 more
    assert res["page_major_s1_km1"]["v4"] >= res["part_major_s1_km1"]["v4"] + 4, res
    assert res["page_major_s3_km1"]["cp16"] > 0 and res["part_major_s3_km1"]["cp16"] == 0, res
    for lay in ("part_major", "page_major"):
        a, b = res[f"{lay}_s1_km1"], res[f"{lay}_s1_km0"]
        assert a["bar"] < b["bar"] and a["shfl"] < b["shfl"], res


_GLUON_FILTER_SCRIPT = r"""
from triton.experimental.gluon._runtime import GluonASTSource
from cpkv_backend_triton.kernels.topk_gluon import _topk_filter_gluon_kernel as K

ptrs = {"x_ptr": "*fp32", "ks_ptr": "*i64", "ke_ptr": "*i64", "floor_ptr": "*fp32",
        "cand_ptr": "*i64", "count_ptr": "*i32"}
const = {"BLOCK": 1024, "CAP": 16384, "num_warps": 4}
ptx = sm90(K, ptrs, const, [*ptrs, "sx0"], GluonASTSource, num_warps=4).asm["ptx"]
out = {"v4": len(re.findall(r"ld\.global(?:\.[\w:]+)*\.v4\.b32\s", ptx)),
       "bar": len(re.findall(r"bar\.sync", ptx)), "shfl": len(re.findall(r"shfl\.sync", ptx)),
       "st_shared": len(re.findall(r"st\.shared", ptx)), "ptx": ptx}
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_gluon_topk_filter_scans_inside_threads(tmp_path: Path) -> None:
    """The Gluon filter at 1024 columns a block, 4 warps: each thread's 8 consecutive columns
    come in 2 16-byte loads (the unmasked blocks), the block's scan is one warp scan (the
    Triton filter's coalesced layout needs 8: 48 shuffles a block) and one exchange across
    warps (a few barriers: the Triton filter with 16-byte loads converted the block through
    shared memory, 24 barriers); no spill where a ptxas reads the PTX."""
    _needs_gluon()
    res = compile_script(_GLUON_FILTER_SCRIPT)
    res["ptxas"] = ptxas_report(res.pop("ptx"), tmp_path)
    # the unmasked blocks' loads; the masked last block's are scalar
    assert res["v4"] == 2, res
    # the scanned bodies (the unmasked loop, the masked last block), each: a sum and a scan
    # across warps
    bodies = 2
    assert res["shfl"] <= bodies * 8 and res["bar"] <= bodies * 5, res
    assert res["st_shared"] <= bodies * 3, res
    if res["ptxas"] is None:
        pytest.skip("no ptxas here reads this PTX version: spills not checked")
    assert "0 bytes spill stores" in res["ptxas"], res["ptxas"]


_INDEXER_SCRIPT = r"""
from cpkv_backend_triton.kernels.indexer import _indexer_kernel as K
from cpkv_backend_triton.tuning import Launch, row

cfg = row(Launch.INDEXER, "NVIDIA H200", (9, 0)).params.as_dict()
ptrs = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
        "ks_ptr": "*i64", "ke_ptr": "*i64", "out_ptr": "*fp32"}
# what a real launch specializes: unit strides, 16-byte aligned pointers and row strides
const = {"sq2": 1, "sk1": 1, "sw1": 1, "H": 64, "D": 128, "DP": 128,
         "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "FP8": True, "UPCAST": False}
k = sm90(K, ptrs, const, [*ptrs, "sq0", "sq1", "sw0", "sk0", "so0"],
         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
print(json.dumps({"ptx": k.asm["ptx"], "threads": 32 * cfg["num_warps"]}))
"""


@pytest.mark.multiprocess
def test_prefill_indexer_keeps_three_ctas_an_sm(tmp_path: Path) -> None:
    """The fp8 prefill indexer at its tuned launch (DeepSeek's 64 heads x 128) fits 3 CTAs an
    SM in registers, without spills: Nsight Compute found it latency-bound at 3 warps a
    scheduler (docs/triton.md), and every variant measured above ~170 registers
    (2 CTAs an SM) was slower whatever it saved (the ``|s|`` split at 201: 0.86x)."""
    res = compile_script(_INDEXER_SCRIPT)
    report = ptxas_report(res["ptx"], tmp_path)
    if report is None:
        pytest.skip("no ptxas here reads this PTX version: registers not checked")
    m = re.search(r"Used (\d+) registers", report)
    assert m is not None, report
    regs = int(m.group(1))
    # registers are allocated a warp at a time in units of 256 (8 a thread)
    per_cta = -(-regs // 8) * 8 * res["threads"]
    assert 65536 // per_cta >= 3, (regs, report)
    assert "0 bytes spill stores" in report, report
