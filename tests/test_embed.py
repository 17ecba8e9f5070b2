"""Issue 37: cpkv embedded in an engine (cpkv.embed): the pool over caller-given storage, the
per-layer custom ops under torch.compile(fullgraph=True), the engines' two-part layout through
materialization, transfer and the host tier (bit-exact against cpkv's own pool), the
fixed-capacity decode metadata and the prefix-cache rules as pure functions."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.comm import CPGroup
from cpkv.contracts import KVFormat, RequestSpec, SplitMode
from cpkv.embed import (
    DecodeMetadata,
    EngineKV,
    KVBufferSpec,
    backend_ops,
    hit_pages,
    key_ranges,
    pack_rows,
    read_pages,
    read_rows,
    tail_copy,
    token_valid_hit,
    write_pages,
    write_rows,
)
from cpkv.kv import ShardedKVPool
from cpkv.planning import plan_batch
from cpkv.runtime.launch import run_ranks

FP8 = KVFormat(dtype="fp8", page_size=8, kv_lora_rank=32, rope_dim=8, index_head_dim=16,
               quant_block=16)


def _compute_rows(n: int, seed: int, fmt: KVFormat = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, fmt.kv_lora_rank + fmt.rope_dim, generator=g),
            torch.randn(n, fmt.index_head_dim, generator=g))


def _interleaved_pages(plan_owners: Sequence[int | None], start: int, base: int
                       ) -> list[tuple[int, int]]:
    """An engine's allocator: page k on its plan owner at slot ``base + k`` (one slot id
    shared by every rank, vLLM's and SGLang's pattern)."""
    return [(o, base + k) for k, o in enumerate(plan_owners) if k >= start and o is not None]


# ---- the pool over given storage ---------------------------------------------------------------
@pytest.mark.parametrize("layout", ["token_major", "part_major", "two_part"])
def test_pool_wraps_the_callers_tensors_in_place(layout: str) -> None:
    g = CPGroup.single()
    spec = KVBufferSpec.allocate(FP8, 2, 6, layout)
    pool = ShardedKVPool(FP8, 2, g, backend_ops(g), storage=spec)
    assert pool.store.spec is spec  # every part of every layer is the caller's tensor
    assert [[r.data_ptr() for r in regs] for regs in pool.store.regions] == [
        [t.data_ptr() for t in lb.parts()] for lb in spec.layers]
    plan = plan_batch([(0, 20)], 1, FP8.page_size)
    batch = pool.prepare(plan, ["a"])
    lat, idx = _compute_rows(20, 1)
    pool.write(1, batch, lat, idx)
    pool.commit(batch)
    rows = torch.tensor([s * 8 + o for s in pool.pages.requests["a"].slots for o in range(8)])[:20]
    got_l, got_i = read_rows(spec, 1, rows)  # the pool wrote into the caller's tensors
    assert torch.equal(got_l, pack_rows(lat, FP8, "latent", pool.store.ops))
    assert got_i is not None and torch.equal(got_i, pack_rows(idx, FP8, "index_k", pool.store.ops))
    with pytest.raises(ValueError, match=r"storage holds 2 layers"):  # not the pool's formats
        ShardedKVPool(FP8.latent_only(), 2, g, backend_ops(g), storage=spec)


# ---- the custom ops under torch.compile -------------------------------------------------------
def _forward(kv: EngineKV, batch: object, lat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    from cpkv.embed import EngineBatch

    assert isinstance(batch, EngineBatch)
    kv.put_bytes(0, batch, lat, idx)
    rows = kv.view_rows(0, batch)
    back, _ = kv.take_bytes(0, batch.kv.direct_dst)
    return rows.float().sum(1) + back.float().mean()


def _compiled_equals_eager(backend: str) -> None:
    g = CPGroup.single()
    spec = KVBufferSpec.allocate(FP8, 1, 8, "two_part")
    kv = EngineKV(spec, g, backend_ops(g))
    plan = kv.plan([("a", 20)])
    batch = kv.prepare(plan, ["a"], given={"a": [(0, 5), (0, 2), (0, 7)]})
    ops = kv.ops
    lat, idx = (pack_rows(x, FP8, p, ops) for x, p in zip(_compute_rows(20, 3),
                                                          ("latent", "index_k"), strict=True))
    eager = _forward(kv, batch, lat, idx)
    written = [t.clone() for t in spec.layers[0].parts()]
    for t in spec.layers[0].parts():
        t.zero_()
    compiled = torch.compile(_forward, fullgraph=True, backend=backend)(kv, batch, lat, idx)
    assert torch.equal(compiled, eager)
    assert all(torch.equal(a, b) for a, b in zip(spec.layers[0].parts(), written, strict=True))
    kv.close()


def test_per_layer_ops_compile_fullgraph_and_equal_eager() -> None:
    """fullgraph tracing through the custom ops (fake kernels, the writes' mutation), run by
    aot_eager: no graph break, the eager result and the same bytes written."""
    _compiled_equals_eager("aot_eager")


@pytest.mark.slow
def test_per_layer_ops_compile_with_inductor() -> None:
    """The default backend (inductor: ~17 s to compile on a loaded CPU)."""
    _compiled_equals_eager("inductor")


def _compile_on_ranks(group: CPGroup, backend: str) -> bool:
    """CP ranks: a short request (owner writes after the row all-gather, ``cpkv::gather_rows``)
    and a long one (direct writes), then the view (``cpkv::all_gather_pages``), compiled
    fullgraph vs eager."""
    spec = KVBufferSpec.allocate(FP8, 1, 16, "two_part")
    kv = EngineKV(spec, group, backend_ops(group))
    plan = kv.plan([("a", 40), ("b", 5)])
    given = {rid: _interleaved_pages(req.page_owners, 0, 8 * i)
             for i, (rid, req) in enumerate(zip(("a", "b"), plan.requests, strict=True))}
    batch = kv.prepare(plan, ["a", "b"], given=given)
    lat, idx = (pack_rows(x, FP8, p, kv.ops) for x, p in zip(
        _compute_rows(batch.kv.rows.num_local, 5 + group.rank), ("latent", "index_k"),
        strict=True))
    eager = _forward(kv, batch, lat, idx)
    for t in spec.layers[0].parts():
        t.zero_()
    compiled = torch.compile(_forward, fullgraph=True, backend=backend)(kv, batch, lat, idx)
    return bool(torch.equal(compiled, eager))


@pytest.mark.multiprocess
@pytest.mark.slow  # 13 CPU seconds
def test_per_layer_ops_compile_fullgraph_on_two_ranks() -> None:
    """The collectives inside the ops (the owner write's row all-gather, the page all-gather)
    traced fullgraph on 2 Gloo ranks, run by aot_eager: the eager result on each rank."""
    results = run_ranks(_compile_on_ranks, 2, args=("aot_eager",), timeout_s=300)
    assert all(r.value for r in results)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_per_layer_ops_compile_with_inductor_on_two_ranks() -> None:
    """The same with inductor: rank 1 owns none of the gathered rows of the short request, and
    its graph still makes the row all-gather (a separate pure gather op was dropped there)."""
    results = run_ranks(_compile_on_ranks, 2, args=("inductor",), timeout_s=300)
    assert all(r.value for r in results)


# ---- two_part against cpkv's own pool on CP ranks ---------------------------------------------
def _two_part_vs_pool(group: CPGroup, mode: str) -> dict[str, object]:
    """The same rows through cpkv's pool (token-major) and through EngineKV over two-part
    tensors: equal full views per layer; a transfer of each rank's manifest pages and a host
    round trip give the pool's bytes."""
    ops = backend_ops(group)
    pool = ShardedKVPool(FP8, 2, group, ops, pages_per_rank=16)
    spec = KVBufferSpec.allocate(FP8, 2, 16, "two_part")
    kv = EngineKV(spec, group, ops, mode=mode)
    ptrs = [t.data_ptr() for lb in spec.layers for t in lb.parts()]
    out: dict[str, object] = {}
    # batch 1: a page-aligned long request and a short one (owner writes); batch 2 continues
    # "a" from a prefix ending mid-page (the head fragment on the tail page's owner)
    for step, batch_spec in enumerate(([("a", 45), ("b", 5)], [("a", 30)])):
        plan = plan_batch([pool.pages.request_spec(r, n) for r, n in batch_spec], group.size,
                          FP8.page_size, SplitMode(mode))
        eplan = kv.plan(batch_spec)
        assert eplan == plan
        rids = [r for r, _ in batch_spec]
        pb = pool.prepare(plan, rids)
        given = {rid: _interleaved_pages(req.page_owners,
                                         len(kv.request_pages(rid)),
                                         12 * i)
                 for i, (rid, req) in enumerate(zip(rids, plan.requests, strict=True))}
        eb = kv.prepare(plan, rids, given=given)
        n = eb.kv.rows.num_local
        assert n == len(eb.ranges.position) and eb.positions.tolist() == list(eb.ranges.position)
        for layer in range(2):
            lat, idx = _compute_rows(pb.rows.num_local, 10 * step + layer + group.rank)
            pool.write(layer, pb, lat, idx)
            kv.put_bytes(layer, eb, pack_rows(lat, FP8, "latent", ops),
                         pack_rows(idx, FP8, "index_k", ops))
            want = pool.materialize(layer, pb)
            got = kv.view(layer, eb)
            out[f"view{step}{layer}"] = (torch.equal(got.latent(), want.latent())
                                         and torch.equal(got.index_k(), want.index_k()))
        pool.commit(pb)
        kv.commit(eb)
    # transfer: each rank sends its manifest pages; a decode side (one rank, part-major) lands
    # them at their logical positions; compare with the pool's own pages, page by page
    m = kv.manifest("a")
    sent = kv.send_pages(m)
    rp = pool.pages.requests["a"]
    ok = True
    for logical, blocks in sent:
        slots = torch.tensor([rp.slots[k] for k in logical])
        for layer in range(2):
            ok &= torch.equal(blocks[layer], pool.store.kv[layer].index_select(0, slots))
            host = blocks[layer].cpu().clone()  # the host tier: out and back to other slots
            dst = torch.tensor(logical) + 3
            write_pages(spec, layer, dst, host)
            ok &= torch.equal(read_pages(spec, layer, dst), blocks[layer])
    out["transfer"] = ok and sum(len(lg) for lg, _ in sent) == sum(
        1 for o in rp.owners if o == group.rank)
    out["no_copy"] = ptrs == [t.data_ptr() for lb in spec.layers for t in lb.parts()]
    return out


@pytest.mark.multiprocess
# 9 CPU seconds each: interleave is slow, zigzag keeps the behaviour in the fast subset
@pytest.mark.slow  # 10 CPU seconds each
@pytest.mark.parametrize("mode", ["zigzag", "interleave"])
def test_two_part_views_transfer_and_host_tier_equal_cpkv_pool_cp2(mode: str) -> None:
    results = run_ranks(_two_part_vs_pool, 2, args=(mode,), timeout_s=120)
    for r in results:
        assert r.value and all(r.value.values()), (r.rank, r.value)


# ---- decode metadata ---------------------------------------------------------------------------
def test_decode_metadata_is_filled_in_place() -> None:
    md = DecodeMetadata(max_requests=3, max_pages=4, page_size=8, pad_row=8 * 9)
    ptrs = (md.block_table.data_ptr(), md.seq_lens.data_ptr(), md.write_rows.data_ptr())
    md.fill([[5, 2], [7]], [9, 8])
    assert md.block_table.tolist() == [[5, 2, -1, -1], [7, -1, -1, -1], [-1] * 4]
    assert md.seq_lens.tolist() == [9, 8, 0] and md.write_rows.tolist() == [2 * 8 + 0, 7 * 8 + 7, 72]
    md.fill([[1]], [3])
    assert md.block_table[1].tolist() == [-1] * 4 and md.write_rows.tolist() == [10, 72, 72]
    assert (md.block_table.data_ptr(), md.seq_lens.data_ptr(), md.write_rows.data_ptr()) == ptrs
    # a fixed-shape write of every row (what a CUDA graph replays): padding lands on the scratch
    # page (slot 9) only
    g = CPGroup.single()
    spec = KVBufferSpec.allocate(FP8, 1, 10, "two_part")
    kv = EngineKV(spec, g, backend_ops(g))
    lat, idx = (torch.full((3, FP8.latent_bytes_per_token), 7, dtype=torch.uint8),
                torch.full((3, FP8.index_bytes_per_token), 9, dtype=torch.uint8))
    a, b = spec.layers[0].parts()
    torch.ops.cpkv.put_bytes(a, b, md.write_rows, lat, idx, kv.handle)
    got_l, got_i = read_rows(spec, 0, torch.tensor([10]))
    assert bool((got_l == 7).all()) and got_i is not None and bool((got_i == 9).all())
    touched = {int(p) for p in (a.view(10, -1) != 0).any(1).nonzero().flatten()}
    assert touched == {1, 9}
    kv.close()
    with pytest.raises(ValueError, match="capacity of 3"):
        md.fill([[1]] * 4, [1] * 4)
    with pytest.raises(ValueError, match=r"2 pages for 17 keys \(capacity"):
        md.fill([[1, 2]], [17])


# ---- the rules ---------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 90)), min_size=1, max_size=3),
       c=st.integers(1, 4), mode=st.sampled_from(list(SplitMode)))
def test_key_ranges_cover_each_row_causally(lens: list[tuple[int, int]], c: int,
                                            mode: SplitMode) -> None:
    specs = [RequestSpec(prefix_len=p, extend_len=e,
                         prefix_owners=tuple(k % c for k in range(-(-p // 8))))
             for p, e in lens]
    plan = plan_batch(specs, c, 8, mode)
    seen = []
    for r in range(c):
        kr = key_ranges(plan, r)
        assert len(kr.position) == plan.rank_counts[r]
        first = [sum(p + e for p, e in lens[:i]) for i in range(len(lens))]
        for q, pos, ks, ke in zip(kr.request, kr.position, kr.key_start, kr.key_end, strict=True):
            assert ks == first[q] and ke - ks == pos + 1 and ke <= kr.num_keys
            seen.append((q, pos))
    assert sorted(seen) == sorted((i, p) for i, (pr, e) in enumerate(lens)
                                  for p in range(pr, pr + e))


def test_prefix_rules() -> None:
    assert token_valid_hit(100, 90, 200) == 90  # only valid tokens are a hit
    assert token_valid_hit(100, 130, 100) == 99  # the prompt's last token is computed
    assert token_valid_hit(100, 130, 200, other_ranks=[64]) == 64  # every rank the same
    pages = hit_pages(90, [0, 1, 0, 1], [4, 4, 9, 2], 64)
    assert pages == ((0, 4), (1, 4))  # the tail page (ends mid-page) with its owner
    tc = tail_copy(90, pages, 64)
    assert tc is not None and (tc.page, tc.owner, tc.src_slot) == (1, 1, 4)
    assert tail_copy(128, hit_pages(128, [0, 1], [4, 4], 64), 64) is None  # page-aligned hit
    assert tail_copy(90, pages, 64, shared=False) is None
    with pytest.raises(ValueError, match="covers 3 pages"):
        hit_pages(129, [0, 1], [4, 4], 64)


# ---- the prefix cache and its host tier over given storage --------------------------------------
def _pattern(fmt: KVFormat, layer: int, toks: Sequence[int], pos: range) -> torch.Tensor:
    """Packed rows whose bytes encode (layer, token, position)."""
    v = torch.tensor([(layer * 7 + toks[p] * 3 + p) % 251 for p in pos], dtype=torch.uint8)
    return v[:, None].expand(len(pos), fmt.bytes_per_token).contiguous()


@pytest.mark.parametrize("layout", ["token_major", "part_major"])
def test_prefix_cache_and_host_tier_over_given_storage(layout: str) -> None:
    """A pool over the caller's tensors: prefixes evicted to the host tier come back on a hit,
    byte for byte, into the caller's tensors (never replaced)."""
    from cpkv.cache import PrefixCache
    from cpkv.kv.host import HostPages

    fmt = KVFormat(dtype="bf16", page_size=4, kv_lora_rank=16, rope_dim=8, index_head_dim=8,
                   quant_block=8)
    g = CPGroup.single()
    spec = KVBufferSpec.allocate(fmt, 2, 6, layout)
    ptrs = [lb.parts()[0].data_ptr() for lb in spec.layers]
    pool = ShardedKVPool(fmt, 2, g, backend_ops(g), storage=spec)
    cache = PrefixCache(pool.pages, pool.store, g, HostPages(fmt, 2, 32, 1, g.device))
    nl = fmt.latent_bytes_per_token

    def serve(rid: str, toks: list[int]) -> int:
        hit = cache.attach(rid, cache.agree(cache.match(toks)))
        batch = pool.prepare(plan_batch([pool.pages.request_spec(rid, len(toks) - hit)], 1, 4),
                             [rid])
        rp = pool.pages.requests[rid]
        for layer in range(2):
            pool.prefetch(layer, batch)
            batch.stage.ready(layer)
            rows = torch.tensor([rp.slots[p // 4] * 4 + p % 4 for p in range(hit, len(toks))])
            pat = _pattern(fmt, layer, toks, range(hit, len(toks)))
            write_rows(spec, layer, rows, pat[:, :nl], pat[:, nl:])
        pool.commit(batch)
        for layer in range(2):  # every position's bytes, the hit's included
            rows = torch.tensor([rp.slots[p // 4] * 4 + p % 4 for p in range(len(toks))])
            lat, idx = read_rows(spec, layer, rows)
            assert idx is not None
            assert torch.equal(torch.cat([lat, idx], 1),
                               _pattern(fmt, layer, toks, range(len(toks)))), (rid, layer)
        cache.insert(rid, toks)
        pool.pages.free(rid)
        return hit

    a, b = list(range(20)), [50 + t for t in range(20)]
    assert serve("a", a) == 0 and serve("b", b) == 0  # a's pages went to the host
    assert cache.stats.pages_saved_to_host == 5
    assert serve("c", [*a[:10], 200, 201]) == 10  # mid-page: loaded, then copied on write
    assert serve("a2", [*a, 7]) == 20 and cache.stats.pages_loaded_from_host > 3
    assert [lb.parts()[0].data_ptr() for lb in spec.layers] == ptrs
    assert [t.data_ptr() for t in pool.store.kv] == ptrs
