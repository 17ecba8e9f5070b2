"""One in-place pass that turns DeepGEMM's compressed indexer rows into the op's rows.

``fp8_fp4_mqa_logits`` writes row i's logit of key ``ks[i] + c`` at column c and leaves the
columns past ``ke[i] - ks[i]`` unwritten. :func:`place_rows` moves each row whose range does not
start at 0 right by ``ks[i]`` (block by block from its end, a barrier between a block's load
and its store, so no element is read after it was overwritten) and writes -inf at
``[0, ks[i])`` and ``[ke[i], T)``. A row starting at 0 (every row of a prompt's own chunk) costs
only its tail: for a causal chunk the triangle past each row's end, not the [N, T] matrix.
Launched on the logits' stream; no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["PLACE_CONFIG", "place_rows"]

#: the pass's launch: columns per step, warps per row (one program per row)
PLACE_CONFIG: dict[str, int] = {"BLOCK": 2048, "num_warps": 8}


@triton.jit
def _place_kernel(x_ptr, ks_ptr, ke_ptr, T, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ks = tl.load(ks_ptr + row)
    ke = tl.load(ke_ptr + row)
    base = x_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    span = tl.maximum(ke - ks, 0)
    if ks > 0:
        nblk = tl.cdiv(span, BLOCK)
        for b in range(0, nblk):
            cols = (nblk - 1 - b) * BLOCK + offs
            m = cols < span
            v = tl.load(base + cols, mask=m)
            tl.debug_barrier()  # every thread's load of this block before any store into it
            tl.store(base + ks + cols, v, mask=m)
            tl.debug_barrier()
        for c0 in range(0, ks, BLOCK):
            cols = c0 + offs
            tl.store(base + cols, float("-inf"), mask=cols < ks)
    lo = tl.maximum(ke, ks)
    for c0 in range((lo // BLOCK) * BLOCK, T, BLOCK):
        cols = c0 + offs
        tl.store(base + cols, float("-inf"), mask=(cols >= lo) & (cols < T))


def place_rows(out: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> None:
    """In place: ``out`` (float32 [N, T], unit column stride) from DeepGEMM's compressed rows to
    the op's (row i's keys at their columns, -inf outside ``[ks[i], ke[i])``). ``ks`` / ``ke``
    int32 [N] on ``out``'s device."""
    n, t = out.shape
    if n == 0 or t == 0:
        return
    cfg = PLACE_CONFIG
    _place_kernel[(n,)](out, ks, ke, t, out.stride(0), BLOCK=cfg["BLOCK"],
                        num_warps=cfg["num_warps"])
