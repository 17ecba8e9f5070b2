"""What the Triton kernels compile to for Hopper (PTX, built on the CPU: no GPU needed): the paged
indexer reads its gathered fp8 key rows with 4-byte loads, not byte by byte (the decode step's
cost at long contexts, docs/lessons.md). The compile runs in a fresh interpreter: other test
modules import the kernels under the Triton CPU interpreter, which the compiler cannot take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

_SCRIPT = r"""
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cpkv_backend_triton.attention import _indexer_paged_kernel, _row_alignment

names = list(inspect.signature(_indexer_paged_kernel.fn).parameters)
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
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn=_indexer_paged_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
    out[label] = {w: len(re.findall(r"ld\.global\." + w + r"\b", ptx)) for w in ("b8", "b32")}
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_paged_indexer_key_loads_are_vectorized() -> None:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip(f"this Triton has no bundled ptxas ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["kalign"] == 4  # the DeepSeek fp8 pool's key rows start on 4-byte boundaries
    assert res["without"]["b8"] >= 128  # the key tile byte by byte
    assert res["with_hint"]["b8"] == 0 and res["with_hint"]["b32"] >= 32
