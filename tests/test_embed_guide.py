"""An engine written from docs/embedding.md alone (not from examples/engine/): its own two-part
KV tensors, its own slots handed out top-down, its own prefix cache (a 200-token hit ending
inside a page, the page shared with the cache), its own torch indexer, top-k and sparse MLA, and
cpkv only through the names the guide lists. Its last-token logits equal ``PrefillSession``'s:
fp32 at CP1, CP2 and CP4 on Gloo, fp8 (DeepSeek's write recipe through ``quantize``, queries
through ``rotate_index_q``) at CP1 and CP2, within 1e-5 relative."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import pytest
import torch

import cpkv
from cpkv.embed import (
    EngineBatch,
    EngineKV,
    KVBufferSpec,
    LayerKV,
    hit_pages,
    rotate_index_q,
    token_valid_hit,
)
from cpkv.runtime.launch import run_ranks

PS = 16
CAPACITY = 64


def indexer(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
            ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """The engine's lightning indexer: sum_h w relu(q . k) inside [ks, ke), -inf elsewhere."""
    kf = k.float() * k_scale[:, None] if k_scale is not None else k.float()
    logits = (torch.einsum("nhd,td->nht", q.float(), kf).relu() * w.float()[:, :, None]).sum(1)
    col = torch.arange(kf.shape[0])
    inside = (col[None, :] >= ks[:, None]) & (col[None, :] < ke[:, None])
    return logits.masked_fill(~inside, float("-inf"))


def topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best keys per row (equal logits: the lower column), -1 where a row has fewer."""
    vals, idx = torch.sort(logits, dim=1, descending=True, stable=True)
    vals, idx = vals[:, :k], idx[:, :k]
    return torch.where(vals > float("-inf"), idx, -1)


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, top: torch.Tensor, scale: float,
               dv: int) -> torch.Tensor:
    """The engine's sparse MLA (absorbed): softmax over the chosen keys, values kv[:, :dv]."""
    keys = kv.float()[top.clamp_min(0)]  # [N, k, D]
    s = torch.einsum("nhd,nkd->nhk", q.float(), keys) * scale
    s = s.masked_fill((top < 0)[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("nhk,nkd->nhd", p, keys[..., :dv])


class Engine:
    def __init__(self, model: cpkv.DeepseekV32, group: cpkv.CPGroup, dtype: str) -> None:
        self.model, self.group = model, group
        fmt = model.kv_format(dtype, PS)
        self.fmt = fmt
        self.latent = [torch.zeros(CAPACITY, PS, fmt.latent_bytes_per_token, dtype=torch.uint8)
                       for _ in range(model.kv_layers)]
        self.index_k = [torch.zeros(CAPACITY, PS * fmt.index_bytes_per_token, dtype=torch.uint8)
                        for _ in range(model.kv_layers)]
        spec = KVBufferSpec.wrap(fmt, "two_part", list(zip(self.latent, self.index_k,
                                                           strict=True)))
        self.kv = EngineKV(spec, group)
        self.layers = [self.kv.layer(i) for i in range(model.kv_layers)]
        # the engine's allocator: per rank, slots handed out from the top down
        self.free = [list(range(CAPACITY)) for _ in range(group.size)]
        self.cache: dict[tuple[int, ...], Hashable] = {}

    def alloc(self, owner: int) -> tuple[int, int]:
        return owner, self.free[owner].pop()

    def prefill(self, rid: Hashable, prompt: list[int], chunk: int = 1 << 30) -> torch.Tensor:
        kv = self.kv
        hit, cached = 0, None
        for toks, crid in self.cache.items():
            n = 0
            while n < min(len(toks), len(prompt)) and toks[n] == prompt[n]:
                n += 1
            h = token_valid_hit(n, kv.valid_len(crid), len(prompt))
            if h > hit:
                hit, cached = h, crid
        if cached is not None:
            owners, slots = zip(*kv.request_pages(cached), strict=True)
            kv.adopt(rid, hit_pages(hit, owners, slots, PS), hit)
        self.hit = hit
        todo = prompt[hit:]
        logits = torch.empty(0)
        while todo:
            new, todo = todo[:chunk], todo[chunk:]
            plan = kv.plan([(rid, len(new))])
            given = {r: [self.alloc(o) for o in owners]
                     for r, owners in kv.owners_to_give(plan, [rid]).items()}
            b = kv.prepare(plan, [rid], given)
            self.copies = len(b.copies)
            x = self.forward(b, torch.tensor(new)[b.token_index])
            logits = self.model.final_logits(b.gather_last(x))[0]
            kv.commit(b)
        kv.retain(kv.request_pages(rid))  # the prefix cache holds the finished prompt
        self.cache[tuple(prompt)] = rid
        return logits

    def forward(self, b: EngineBatch, ids: torch.Tensor) -> torch.Tensor:
        m, x = self.model, self.model.embed(ids)
        rope = m.rope_cos_sin(b.positions, m.dtype, max(b.ranges.position, default=0))
        for i, lk in enumerate(self.layers):
            x = self.layer(i, lk, b, x, rope)
        return x

    def layer(self, i: int, lk: LayerKV, b: EngineBatch, x: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        m, kv = self.model, self.kv
        a = m.attention_inputs(i, x, b.positions, rope)
        kv.put_bytes(lk, b, *kv.quantize(a.latent, a.index_k))
        lat, idx, scale = kv.view(lk, b).keys(a.q.dtype)
        assert a.index_q is not None and a.index_w is not None
        logits = indexer(rotate_index_q(self.fmt, a.index_q), a.index_w, idx, scale,
                         b.key_start, b.key_end)
        top = topk(logits, m.config.index_topk)
        out = sparse_mla(a.q, lat, top, m.softmax_scale, m.config.kv_lora_rank)
        if b.positions.numel():
            x = x + m.output_projection(i, m.attention_values(i, out.to(a.q.dtype)))
        return x + m.mlp(i, x)


def _run(group: cpkv.CPGroup, dtype: str) -> dict[str, Any]:
    model = cpkv.load_model("tiny")
    g = torch.Generator().manual_seed(11)
    a = torch.randint(1, 500, (280,), generator=g).tolist()
    b = a[:200] + torch.randint(1, 500, (50,), generator=g).tolist()
    eng = Engine(model, group, dtype)
    got = {"a": eng.prefill("a", a, chunk=150), "b": eng.prefill("b", b)}
    hit, copies = eng.hit, eng.copies
    settings = cpkv.load_settings(cp={"size": group.size},
                                  kv={"dtype": dtype, "page_size": PS, "pages_per_rank": 64})
    session = cpkv.PrefillSession(model, settings, group)
    diffs = {}
    for rid, prompt in (("a", a), ("b", b)):
        ref = session.prefill([(rid, prompt)]).last_logits[0]
        diffs[rid] = float((got[rid] - ref).abs().max() / ref.abs().max())
    eng.kv.close()
    session.close()
    return {"diffs": diffs, "hit": hit, "copies": copies}


def _check(results: Sequence[Any], tol: float) -> None:
    for r in results:
        v = r.value
        assert v["hit"] == 200 and v["copies"] == 1, v  # 200 = 12 pages of 16 + 8: mid-page
        assert max(v["diffs"].values()) <= tol, (r.rank, v)


def test_guide_engine_fp32_one_rank() -> None:
    out = _run(cpkv.CPGroup.single(), "fp32")
    assert out["hit"] == 200 and out["copies"] == 1
    assert max(out["diffs"].values()) <= 1e-5, out


@pytest.mark.slow  # 27 s at CP2 on a loaded CPU
@pytest.mark.multiprocess
@pytest.mark.parametrize(("ranks", "dtype"), [(2, "fp32"), (4, "fp32"), (2, "fp8")])
def test_guide_engine_equals_prefill_session_on_gloo(ranks: int, dtype: str) -> None:
    _check(run_ranks(_run, ranks, args=(dtype,), timeout_s=300), 1e-5)


def test_guide_engine_fp8_one_rank() -> None:
    """DeepSeek's write recipe (``quantize``: rotated index-K, ue8m0) and the rotated queries:
    the fp8 engine's logits equal PrefillSession's fp8 run's (the same bytes, the same keys)."""
    out = _run(cpkv.CPGroup.single(), "fp8")
    assert max(out["diffs"].values()) <= 1e-5, out
