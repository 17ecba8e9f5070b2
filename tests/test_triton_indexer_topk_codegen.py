"""The fused indexer top-k's kernels compiled for Hopper on the CPU (no GPU needed): they build
with DeepSeek's fp8 operands, the filter's logit tiles take the plain indexer kernel's
tensor-core path (the same wgmma count and shared memory: the same dots, so the same logits), and
its inline-PTX append keeps it at the plain kernel's 3 CTAs an SM (registers, no spill).
The compile runs in a fresh interpreter (other modules import the kernels under the Triton CPU
interpreter, which the compiler cannot take)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triton_interp import compile_script, needs_bundled_ptxas, ptxas_report

pytest.importorskip("triton")

_SCRIPT = r"""
import cpkv_backend_triton.kernels.indexer as A
import cpkv_backend_triton.kernels.indexer_topk as F
from cpkv_backend_triton.indexer_topk import INDEXER_TOPK

PTRS = {"xs_ptr": "*fp32", "q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv",
        "scale_ptr": "*fp32", "ks_ptr": "*i64", "ke_ptr": "*i64", "floor_ptr": "*fp32",
        "val_ptr": "*fp32", "col_ptr": "*i32", "count_ptr": "*i32", "meta_ptr": "*i32"}
TILE = {"H": 64, "D": 128, "DP": 128, "BLOCK_N": 128, "FP8": True, "UPCAST": False}


def build(fn, const, out_ptr="*fp32", **opts):
    k = sm90(fn, {**PTRS, "out_ptr": out_ptr}, {"sq2": 1, "sk1": 1, "sw1": 1, **const},  # unit strides
             [*PTRS, "out_ptr", "sq0", "sq1", "sw0", "sk0", "so0"],
             **{"num_warps": 4, "num_stages": 3, **opts})
    return {"wgmma": len(re.findall(r"wgmma\.mma_async", k.asm["ptx"])),
            "shared": k.metadata.shared}, k.asm["ptx"]


plain, _ = build(A._indexer_kernel, {**TILE, "BLOCK_M": 64})
filt, ptx = build(F._fused_filter_kernel, {**TILE, "BLOCK_M": 64, "ASM": True},
                  maxnreg=INDEXER_TOPK["MAXNREG"])
out = {"plain": plain, "filter": filt,
       "exact": build(F._fused_exact_kernel, {**TILE, "HP": 64}, "*i32")[0],
       "floor": build(F._sample_floor_kernel, {"SP": 4096, "ROUNDS": 4})[0],
       "select": build(F._fused_select_kernel, {"KP": 2048, "RB": 1024}, "*i32")[0],
       "filter_ptx": ptx}
print(json.dumps(out))
"""


@pytest.mark.slow  # 7 s of sm90 compiles
@pytest.mark.multiprocess
def test_fused_kernels_compile_for_hopper_on_the_indexers_tensor_cores(tmp_path: Path) -> None:
    """The filter's tiles are the plain kernel's."""
    needs_bundled_ptxas()
    res = compile_script(_SCRIPT)
    assert res["plain"]["wgmma"] > 0
    assert res["filter"] == res["plain"]  # the same tiles on the same tensor-core path
    assert res["exact"]["wgmma"] > 0  # the flagged rows' heads stacked in one fp8 dot
    report = ptxas_report(res["filter_ptx"], tmp_path)
    if report is None:
        pytest.skip("no ptxas here reads this PTX version: registers not checked")
    m = re.search(r"Used (\d+) registers", report)
    assert m is not None, report
    # 3 CTAs of 128 threads an SM: at most 170 registers (allocated 8 a thread at a time)
    assert -(-int(m.group(1)) // 8) * 8 * 128 * 3 <= 65536, report
    assert "0 bytes spill stores" in report, report
