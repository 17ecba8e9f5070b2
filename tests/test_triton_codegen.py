"""What the Triton kernels compile to for Hopper (PTX, built on the CPU: no GPU needed): the paged
indexer reads its gathered fp8 key rows with 4-byte loads, not byte by byte (the decode step's
cost at long contexts, docs/lessons.md)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _paged_ptx(kalign: int) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cpkv_backend_triton.attention import _indexer_paged_kernel

    names = list(inspect.signature(_indexer_paged_kernel.fn).parameters)
    const = {"H": 64, "HP": 64, "D": 128, "DP": 128, "S": 64, "BQ": 1, "BLOCK_N": 128,
             "FP8": True, "UPCAST": False, "KALIGN": kalign}
    ptrs = {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
            "bt_ptr": "*i32", "req_ptr": "*i32", "ke_ptr": "*i64", "out_ptr": "*fp32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    # what the JIT's specialization gives a real launch: 16-byte aligned tensors, the page and
    # index-part steps of the DeepSeek fp8 format (50432, 41984) divisible by 16
    aligned = [*ptrs, "k_page", "k_first", "s_page"]
    src = ASTSource(fn=_indexer_paged_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 2})
    return str(kernel.asm["ptx"])


def test_paged_indexer_key_loads_are_vectorized(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpkv_backend_triton.attention import _row_alignment

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip(f"this Triton has no bundled ptxas ({ptxas})")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    kalign = _row_alignment((64 * 788, 64 * 656, 132), 1)  # the DeepSeek fp8 pool's key rows
    assert kalign == 4
    with_hint, without = _paged_ptx(kalign), _paged_ptx(1)
    assert len(re.findall(r"ld\.global\.b8\b", without)) >= 128  # the key tile byte by byte
    assert not re.findall(r"ld\.global\.b8\b", with_hint)
