"""The Triton backend's ``v4_index_topk`` (DeepSeek-V4's indexer top-k on the V3.2 indexer top-k
kernels) at a 1M-token prompt's size on a GPU: 256K compressed index keys, 64 heads x 128, the
top-512, causal limits; the same sets as the torch backend's scores and rule-39 top-k, up to
entries whose scores tie the k-th."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_v4_index_topk_at_256k_keys_equals_torch() -> None:
    from cpkv_backend_torch.v4 import V4TorchOps
    from cpkv_backend_triton.attention import AttentionKernels

    g = torch.Generator(device="cuda").manual_seed(0)
    n, heads, d, e, k = 48, 64, 128, 262144, 512
    q = torch.randn(n, heads, d, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, heads, device="cuda", generator=g) * heads ** -0.5
    keys = torch.randn(e, d, device="cuda", generator=g).to(torch.bfloat16)
    limit = torch.randint(e // 2, e + 1, (n,), device="cuda", generator=g)
    limit[:3] = torch.tensor([0, 100, 512], device="cuda")  # none, fewer than k, exactly k
    got = AttentionKernels().v4_index_topk(q, w, keys, limit, d ** -0.5, k)
    ref = V4TorchOps()
    scores = torch.cat([ref.v4_index_scores(q[i:i + 8], w[i:i + 8], keys, limit[i:i + 8],
                                            d ** -0.5) for i in range(0, n, 8)])
    want = ref.v4_topk(scores, k)
    assert got.dtype == torch.int64 and got.shape == (n, k)
    assert torch.equal((got == -1).sum(1), (want == -1).sum(1))
    for i in range(n):
        mine, theirs = set(got[i].tolist()) - {-1}, set(want[i].tolist()) - {-1}
        if mine == theirs:
            continue
        row = scores[i].double()
        kth = min(float(row[j]) for j in theirs)
        odd = [j for j in mine ^ theirs if abs(float(row[j]) - kth) > 1e-3 * max(1.0, abs(kth))]
        assert not odd, (i, sorted(mine - theirs)[:5], sorted(theirs - mine)[:5])
