"""The sharded KV pool on real CP groups (Gloo, C = 2 and 4): full views equal to a replicated
pool bit for bit, per-rank bytes within the page share, exhaustion that changes nothing."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackReason, KVDtype, KVFormat, SplitMode
from cpkv.fallback import recording
from cpkv.kv import PoolExhausted, ShardedKVPool, pack_rows
from cpkv.ops import OpTable
from cpkv.planning import plan_batch
from cpkv.plugin import PluginHost
from cpkv.runtime import run_ranks
from cpkv.testing.pool_check import (
    PoolScenario,
    kv_ops,
    page_share_bound,
    random_batches,
    run_pool_scenario,
    run_pool_scenarios,
)

SMALL = {"kv_lora_rank": 64, "rope_dim": 16, "index_head_dim": 32, "quant_block": 32}


def _fmt(dtype: KVDtype, page_size: int = 4) -> KVFormat:
    return KVFormat(dtype=dtype, page_size=page_size, **SMALL)


def _scenarios(cp: int, seed: int) -> list[PoolScenario]:
    rng = random.Random(seed)
    out = []
    for mode in SplitMode:
        for dtype in KVDtype:
            for _ in range(2):
                out.append(PoolScenario(batches=random_batches(rng, max_extend=24 * cp),
                                        fmt=_fmt(dtype), mode=mode, seed=rng.randrange(1 << 30)))
    # DeepSeek page size with a prefix ending mid-page
    out.append(PoolScenario(batches=((("x", 700), ("y", 64 * 2 * cp + 5)), (("x", 300),)),
                            fmt=_fmt(KVDtype.FP8, 64), mode=SplitMode.ZIGZAG))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_sharded_full_view_equals_replicated(cp: int) -> None:
    scenarios = _scenarios(cp, seed=cp)
    results = run_ranks(run_pool_scenarios, cp, args=(scenarios,), timeout_s=240)
    # continued requests with whole prefix pages exercise the prefetched (split) path too
    assert sum(r.value[i].prefetched_views for r in results for i in range(len(scenarios))) > 0
    for i, sc in enumerate(scenarios):
        outs = [r.value[i] for r in results]
        for o in outs:
            assert o.mismatches == [], (sc, o.mismatches)
            assert o.views_checked == len(sc.batches) * sc.num_layers
            # rule 11: at most the page share plus one page per request
            assert o.bytes_held <= page_share_bound(o.pages, cp, sc.fmt.page_bytes, sc.num_layers)
            assert o.replica_bytes_held == o.logical_bytes  # the baseline holds everything
        # no replica anywhere: the shards add up to the logical footprint exactly
        assert sum(o.bytes_held for o in outs) == outs[0].logical_bytes
        for rid, (_, total) in outs[0].pages.items():
            assert sum(o.pages[rid][0] for o in outs) == total


#: the KV layer schedules the pool tests run on: DeepSeek-V3.2 (every layer caches index-K) and
#: GLM-5 (shared-indexer layers store their latent only)
SCHEDULES = {"v32": (), "glm5": (1,)}


@pytest.mark.multiprocess
# all_gather views of one format are the fast subset's elsewhere (4.4 CPU seconds here)
@pytest.mark.parametrize("materialize", [pytest.param("all_gather", marks=pytest.mark.slow),
                                         "p2p"])
def test_per_layer_formats_views_equal_replicated_and_hold_no_index_bytes(materialize: str) -> None:
    """A pool whose shared-indexer layers have latent-only formats (GLM-5): the same views as a
    replica and the truth (index views of those layers empty), each rank within its page share
    of a replica that counts index-K for full layers only, the shards summing to it."""
    rng = random.Random(7)
    scenarios = [PoolScenario(batches=random_batches(rng, max_extend=48), fmt=_fmt(dtype),
                              mode=mode, num_layers=3, shared_layers=(1, 2),
                              seed=rng.randrange(1 << 30), materialize=materialize)
                 for dtype, mode in ((KVDtype.FP8, SplitMode.ZIGZAG),
                                     (KVDtype.BF16, SplitMode.INTERLEAVE))]
    results = run_ranks(run_pool_scenarios, 2, args=(scenarios,), timeout_s=120)
    for i, sc in enumerate(scenarios):
        outs = [r.value[i] for r in results]
        full = sc.fmt.page_bytes
        assert sc.page_bytes == full + 2 * sc.fmt.latent_page_bytes < 3 * full
        for o in outs:
            assert o.materialize_mode == materialize
            assert o.mismatches == [], (sc, o.mismatches)
            assert o.views_checked == len(sc.batches) * sc.num_layers
            assert o.bytes_held <= page_share_bound(o.pages, 2, sc.page_bytes, 1)
            assert o.replica_bytes_held == o.logical_bytes
        assert sum(o.bytes_held for o in outs) == outs[0].logical_bytes
        logical_pages = sum(n for _, n in outs[0].pages.values())
        assert outs[0].logical_bytes == logical_pages * sc.page_bytes


def test_latent_only_layers_allocate_no_index_bytes() -> None:
    group = CPGroup.single()
    fmt = _fmt(KVDtype.FP8)
    pool = ShardedKVPool([fmt, fmt.latent_only(), fmt], 3, group, kv_ops(group), pages_per_rank=8)
    assert [b.shape[-1] for b in pool.store.kv] == [fmt.bytes_per_token,
                                                    fmt.latent_bytes_per_token, fmt.bytes_per_token]
    assert pool.store.index_k[1].shape[-1] == 0
    assert pool.store.page_bytes == 2 * fmt.page_bytes + fmt.latent_page_bytes
    with pytest.raises(ValueError, match="one KV format per layer"):
        ShardedKVPool([fmt, fmt], 3, group, kv_ops(group))
    with pytest.raises(ValueError, match="differ only in index_k"):
        ShardedKVPool([fmt, _fmt(KVDtype.BF16)], 2, group, kv_ops(group))


@pytest.mark.multiprocess
@pytest.mark.slow  # 6 CPU seconds
def test_short_extends_use_owner_write_and_report_it() -> None:
    sc = PoolScenario(batches=((("a", 5), ("b", 300)),), fmt=_fmt(KVDtype.BF16), debug=True)
    results = run_ranks(run_pool_scenario, 2, args=(sc,), timeout_s=120)
    for r in results:
        assert r.value.mismatches == []
        reasons = [e.reason for e in r.fallbacks]
        assert FallbackReason.SHORT_EXTEND in reasons and FallbackReason.OWNER_WRITE in reasons
        ev = next(e for e in r.fallbacks if e.reason is FallbackReason.OWNER_WRITE)
        assert ev.op == "kv_write" and "'a' (P=0, E=5)" in ev.detail and "'b'" not in ev.detail


@pytest.mark.multiprocess
@pytest.mark.slow  # 6 CPU seconds
def test_exhaustion_mid_run_changes_nothing_on_any_rank() -> None:
    # 16 pages per rank: the first batch fits, the second needs more on some rank, the third fits
    sc = PoolScenario(batches=((("a", 40), ("b", 40)), (("c", 90), ("a", 30)), (("d", 8),)),
                      fmt=_fmt(KVDtype.FP8), pages_per_rank=16)
    results = run_ranks(run_pool_scenario, 2, args=(sc,), timeout_s=120)
    for r in results:
        o = r.value
        assert len(o.exhausted) == 1 and o.exhausted[0].startswith("batch 1:")
        assert "needs" in o.exhausted[0] and "nothing was allocated" in o.exhausted[0]
        assert o.unchanged_after_exhaustion and o.mismatches == []
        assert set(o.pages) == {"a", "b", "d"}  # the pool stayed usable for the next batch


def _pool(shared: bool = True, **kw: object) -> tuple[ShardedKVPool, OpTable]:
    host = PluginHost()
    ops = OpTable.resolve(host.backends(), ["torch"])
    host.close()
    return ShardedKVPool(_fmt(KVDtype.BF16), 1, CPGroup.single(), ops, shared=shared, **kw), ops


def test_single_rank_pool_equals_truth_both_formats() -> None:
    for dtype in KVDtype:
        sc = PoolScenario(batches=random_batches(random.Random(1), 40), fmt=_fmt(dtype))
        assert run_pool_scenario(CPGroup.single(), sc).mismatches == []


@pytest.mark.parametrize("layout", ["token_major", "part_major"])
def test_single_rank_views_read_the_pool_in_place(layout: str) -> None:
    """A one-rank group (the decode rank) owns every page: its views read the pool layer itself
    (no all-gather copy, nothing prefetched, no split plan) and equal a replica's and the
    written rows, across batches that continue requests after whole prefix pages; its gathered
    hidden rows are its local rows."""
    group = CPGroup.single()
    ops = kv_ops(group)
    fmt = _fmt(KVDtype.FP8, 4)
    pools = {shared: ShardedKVPool(fmt, 2, group, ops, shared=shared, pages_per_rank=32,
                                   layout=layout) for shared in (True, False)}
    g = torch.Generator().manual_seed(3)
    written: dict[str, list[torch.Tensor]] = {}
    for batch in ([("a", 13), ("b", 9)], [("a", 1)], [("b", 6), ("a", 1)]):
        n = sum(e for _, e in batch)
        lat = [torch.randn(n, fmt.kv_lora_rank + fmt.rope_dim, generator=g) for _ in range(2)]
        idx = [torch.randn(n, fmt.index_head_dim, generator=g) for _ in range(2)]
        got = {}
        for shared, pool in pools.items():
            plan = plan_batch([pool.pages.request_spec(r, e) for r, e in batch], 1, fmt.page_size)
            kv = pool.prepare(plan, [r for r, _ in batch])
            assert kv.materialize_split is None
            x = torch.randn(n, 3)
            assert kv.rows.gather(x, group, ops) is x
            views = []
            for layer in range(2):
                assert pool.prefetch(layer, kv) is None
                pool.write(layer, kv, lat[layer], idx[layer])
                v = pool.materialize(layer, kv)
                assert v.pages.data_ptr() == pool.store.kv[layer].data_ptr()  # read in place
                views.append((v.latent(), v.index_k()))
            got[shared] = views
            pool.commit(kv)
        assert all(torch.equal(a, b) for va, vb in zip(got[True], got[False], strict=True)
                   for a, b in zip(va, vb, strict=True))
        off = 0
        for r, e in batch:  # every request's rows so far, in the view's natural order
            rows = written.setdefault(r, [torch.empty(0, lat[0].shape[1] + idx[0].shape[1])] * 2)
            written[r] = [torch.cat([rows[ly], torch.cat([lat[ly], idx[ly]], 1)[off:off + e]])
                          for ly in range(2)]
            off += e
        for layer, (vl, vi) in enumerate(got[True]):
            d = lat[0].shape[1]
            want = torch.cat([written[r][layer] for r, _ in batch])
            assert torch.equal(vl, pack_rows(want[:, :d], fmt, "latent", ops))
            assert torch.equal(vi, pack_rows(want[:, d:], fmt, "index_k", ops))


def test_prepare_rejects_a_plan_that_disagrees_with_the_pool() -> None:
    pool, _ = _pool()
    with pytest.raises(ValueError, match="plan is for CP2"):
        pool.prepare(plan_batch([(0, 8)], 2, 4), ["a"])
    batch = pool.prepare(plan_batch([(0, 8)], 1, 4), ["a"])
    pool.commit(batch)
    with pytest.raises(ValueError, match="request 'a': the plan's prefix is 0 tokens, the pool holds 8"):
        pool.prepare(plan_batch([(0, 8)], 1, 4), ["a"])
    with pytest.raises(ValueError, match="one distinct request id"):
        pool.prepare(plan_batch([(0, 8), (0, 3)], 1, 4), ["b", "b"])


def test_abort_and_free_return_every_page() -> None:
    pool, _ = _pool(pages_per_rank=8)
    empty = pool.pages.allocator.snapshot()
    batch = pool.prepare(plan_batch([pool.pages.request_spec("a", 10)], 1, 4), ["a"])
    assert pool.footprint().pages_held == 3
    pool.abort(batch)
    assert pool.pages.allocator.snapshot() == empty and pool.pages.requests == {}
    pool.commit(pool.prepare(plan_batch([pool.pages.request_spec("a", 10)], 1, 4), ["a"]))
    pool.pages.free("a")
    assert pool.pages.allocator.snapshot() == empty and pool.footprint().bytes_held == 0


def test_exhaustion_error_names_the_rank_and_counts() -> None:
    pool, _ = _pool(pages_per_rank=2)
    with pytest.raises(PoolExhausted, match="rank 0 needs 3 pages, has 2 free"):
        pool.prepare(plan_batch([(0, 10)], 1, 4), ["a"])
    assert pool.pages.requests == {} and pool.footprint().pages_held == 0


class _TwoRanks:
    """Rank 0 of a 2-rank group, for host-side paths that run before any collective."""

    rank, size, device = 0, 2, CPGroup.single().device


def test_owner_write_refused_by_error_policy_leaves_pool_unchanged() -> None:
    host = PluginHost()
    ops = OpTable.resolve(host.backends(), ["torch"])
    host.close()
    pool = ShardedKVPool(_fmt(KVDtype.BF16), 1, _TwoRanks(), ops, pages_per_rank=8)  # type: ignore[arg-type]
    with recording():
        plan = plan_batch([(0, 5)], 2, 4)  # short extend: not page-aligned
    before = pool.pages.allocator.snapshot()
    with recording("error"), pytest.raises(Exception, match="owner_write"):
        pool.prepare(plan, ["a"])
    assert pool.pages.allocator.snapshot() == before and pool.pages.requests == {}


def _ranks_plan_differently(group: CPGroup) -> None:
    host = PluginHost()
    ops = OpTable.resolve(host.backends(), ["torch"])
    host.close()
    pool = ShardedKVPool(_fmt(KVDtype.BF16), 1, group, ops, pages_per_rank=16, debug=True)
    extend = 40 if group.rank == 0 else 44  # a rank-local input difference: a bug to catch
    pool.prepare(plan_batch([(0, extend)], group.size, 4), ["a"])


@pytest.mark.multiprocess
def test_debug_switch_catches_ranks_that_planned_differently() -> None:
    from cpkv.runtime import RankFailed

    with pytest.raises(RankFailed, match="plan hashes differ"):
        run_ranks(_ranks_plan_differently, 2, timeout_s=60)


def test_paged_translation_points_at_the_rows_the_view_holds() -> None:  # rule 20
    import torch

    from cpkv.kv import ragged_to_paged

    for shared in (True, False):
        pool, _ = _pool(shared=shared, pages_per_rank=32)
        for extend in ([("a", 13), ("b", 6)], [("a", 9)]):
            plan = plan_batch([pool.pages.request_spec(r, e) for r, e in extend], 1, 4)
            batch = pool.prepare(plan, [r for r, _ in extend])
            n = batch.rows.num_local
            pool.write(0, batch, torch.randn(n, 80), torch.randn(n, 32))
            view = pool.materialize(0, batch)
            t = view.latent().shape[0]
            ragged = torch.tensor([[0, t - 1, -1], [t // 2, -1, -1]], dtype=torch.int32)
            owner, phys = ragged_to_paged(ragged, batch)
            assert torch.equal(owner < 0, ragged < 0) and torch.equal(phys < 0, ragged < 0)
            rows = pool.store.latent[0].view(-1, view.latent().shape[1])
            for r, p in zip(ragged.flatten().tolist(), phys.flatten().tolist(), strict=True):
                if r >= 0:
                    assert torch.equal(rows[p], view.latent()[r])
            pool.commit(batch)


# ---- P2P materialization (kv.materialize = "p2p"): shared memory between Gloo ranks --------
@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_p2p_full_view_equals_replicated(cp: int) -> None:
    """Every rank reads the owners' pages straight from their (shared-memory) buffers: the same
    views, bit for bit, as the replica and the truth, in both modes, every format."""
    scenarios = [replace(sc, materialize="p2p") for sc in _scenarios(cp, seed=10 + cp)[::2]]
    results = run_ranks(run_pool_scenarios, cp, args=(scenarios,), timeout_s=240)
    for i, sc in enumerate(scenarios):
        outs = [r.value[i] for r in results]
        for o in outs:
            assert o.materialize_mode == "p2p"
            assert o.mismatches == [], (sc, o.mismatches)
            assert o.views_checked == len(sc.batches) * sc.num_layers
            assert o.prefetched_views == 0  # nothing is staged in p2p mode
        assert sum(o.bytes_held for o in outs) == outs[0].logical_bytes
    for r in results:
        assert r.fallbacks == [] or all(e.reason is not FallbackReason.PEER_MEMORY_UNAVAILABLE
                                        for e in r.fallbacks)


def _p2p_reuse(group: CPGroup) -> list[str]:
    """Batches that free requests and reuse their pages: each view equals the truth."""
    ops = kv_ops(group)
    fmt = _fmt(KVDtype.FP8, 8)
    pool = ShardedKVPool(fmt, 2, group, ops, pages_per_rank=12, materialize="p2p")
    bad = []
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        rid = f"r{step}"
        n = 40 + 7 * step
        plan = plan_batch([pool.pages.request_spec(rid, n)], group.size, fmt.page_size)
        kv = pool.prepare(plan, [rid])
        for layer in range(2):
            lat = torch.randn(n, fmt.kv_lora_rank + fmt.rope_dim, generator=g)
            idx = torch.randn(n, fmt.index_head_dim, generator=g)
            pool.write(layer, kv, kv.rows.split(lat, ops), kv.rows.split(idx, ops))
            view = pool.materialize(layer, kv)
            if not (torch.equal(view.latent(), pack_rows(lat, fmt, "latent", ops))
                    and torch.equal(view.index_k(), pack_rows(idx, fmt, "index_k", ops))):
                bad.append(f"step {step} layer {layer}")
        pool.commit(kv)
        pool.pages.free(rid)  # the next request reuses these pages
    return bad


@pytest.mark.multiprocess
@pytest.mark.slow  # 6 CPU seconds
def test_p2p_pages_freed_and_reused_across_batches() -> None:
    results = run_ranks(_p2p_reuse, 2, timeout_s=120)
    assert [r.value for r in results] == [[], []]


def _p2p_unavailable_on_rank_1(group: CPGroup) -> tuple[str, bool]:
    from cpkv.comm import peer

    if group.rank == 1:  # this rank finds no room for its shared buffer
        peer._shm_dir = lambda need: None
    fmt = _fmt(KVDtype.BF16, 4)
    pool = ShardedKVPool(fmt, 1, group, kv_ops(group), pages_per_rank=8, materialize="p2p")
    plan = plan_batch([pool.pages.request_spec("a", 20)], group.size, fmt.page_size)
    kv = pool.prepare(plan, ["a"])
    lat = torch.randn(20, fmt.kv_lora_rank + fmt.rope_dim)
    idx = torch.randn(20, fmt.index_head_dim)
    pool.write(0, kv, kv.rows.split(lat, pool.store.ops), kv.rows.split(idx, pool.store.ops))
    view = pool.materialize(0, kv)
    return pool.store.views.mode, view.latent().shape == (20, fmt.latent_bytes_per_token)


@pytest.mark.multiprocess
def test_p2p_unavailable_on_one_rank_falls_back_on_every_rank() -> None:
    results = run_ranks(_p2p_unavailable_on_rank_1, 2, timeout_s=120)
    for r in results:
        assert r.value == ("all_gather", True)
        events = [e for e in r.fallbacks if e.reason is FallbackReason.PEER_MEMORY_UNAVAILABLE]
        assert len(events) == 1, r.fallbacks
        assert events[0].selected == "all_gather"
        assert "rank 1: no shared-memory directory" in events[0].detail


def _auto_mode(group: CPGroup) -> tuple[str, list[str]]:
    from structlog.testing import capture_logs

    fmt = _fmt(KVDtype.FP8, 4)
    with capture_logs() as logs:
        pool = ShardedKVPool(fmt, 1, group, kv_ops(group), pages_per_rank=8, materialize="auto")
    return pool.store.views.mode.value, [e["event"] for e in logs]


@pytest.mark.multiprocess
def test_auto_materialization_is_all_gather_on_cpu_ranks_without_a_fallback() -> None:
    """'auto' asks for p2p only where peers map GPU memory: CPU ranks take all_gather quietly
    (an info line, no fallback event), alike on every rank."""
    for r in run_ranks(_auto_mode, 2, timeout_s=120):
        mode, events = r.value
        assert mode == "all_gather" and "cpkv.kv.materialize_auto" in events
        assert r.fallbacks == []


def test_p2p_single_rank_pool_reads_its_own_buffer() -> None:
    group = CPGroup.single()
    fmt = _fmt(KVDtype.FP8, 4)
    pool = ShardedKVPool(fmt, 1, group, kv_ops(group), pages_per_rank=8, materialize="p2p")
    assert pool.store.views.mode == "p2p"
    plan = plan_batch([pool.pages.request_spec("a", 13)], 1, fmt.page_size)
    kv = pool.prepare(plan, ["a"])
    lat = torch.randn(13, fmt.kv_lora_rank + fmt.rope_dim)
    idx = torch.randn(13, fmt.index_head_dim)
    pool.write(0, kv, lat, idx)
    view = pool.materialize(0, kv)
    assert torch.equal(view.latent(), pack_rows(lat, fmt, "latent", pool.store.ops))
    assert torch.equal(view.index_k(), pack_rows(idx, fmt, "index_k", pool.store.ops))
    with pytest.raises(ValueError, match="materialize must be"):
        ShardedKVPool(fmt, 1, group, pool.store.ops, materialize="nvlink")


def _send_starts(group: CPGroup) -> list[tuple[int | None, ...]]:
    """Send lists per batch: consecutive slots (a pool slice, no gather) or not."""
    fmt = _fmt(KVDtype.FP8, 4)
    pool = ShardedKVPool(fmt, 1, group, kv_ops(group), pages_per_rank=16)
    out = []
    g = torch.Generator().manual_seed(2)  # the same rows on every rank
    for rid, n, free in (("a", 24, None), ("b", 8, None), ("c", 8, "a"), ("d", 40, None)):
        plan = plan_batch([pool.pages.request_spec(rid, n)], group.size, fmt.page_size)
        kv = pool.prepare(plan, [rid])
        lat = torch.randn(n, fmt.kv_lora_rank + fmt.rope_dim, generator=g)
        idx = torch.randn(n, fmt.index_head_dim, generator=g)
        pool.write(0, kv, kv.rows.split(lat, pool.store.ops), kv.rows.split(idx, pool.store.ops))
        view = pool.materialize(0, kv)
        assert torch.equal(view.latent(), pack_rows(lat, fmt, "latent", pool.store.ops))
        assert torch.equal(view.index_k(), pack_rows(idx, fmt, "index_k", pool.store.ops))
        out.append(kv.materialize.send_start)
        pool.commit(kv)
        if free:
            pool.pages.free(free)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow  # 6 CPU seconds
def test_consecutive_owned_pages_are_sent_from_the_pool_without_a_gather() -> None:
    res = run_ranks(_send_starts, 2, timeout_s=120)
    for r in res:
        a, b, c, d = r.value
        assert a == (0,)  # a fresh pool: 3 pages per rank at slots 0, 1, 2
        assert b == (3,)  # the next free slots
        # "a" freed: its slots 0-2 come back first and "c" takes one of them; "d" then gets
        # slots 1, 2 (freed) and 5.. (never used): not consecutive, so one page gather
        assert c[0] is not None and d == (None,)


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("dtype", [KVDtype.FP8, KVDtype.BF16])
def test_part_major_pages_hold_latent_rows_then_index_rows(dtype: KVDtype,
                                                           schedule: tuple[int, ...]) -> None:
    """A part-major pool (the decode rank's) stores each page as its latent rows then its index-K
    rows, still one block; its views, the compute keys and the selected latent rows equal a
    token-major pool's for the same writes (requests ending mid-page, then continued)."""
    from cpkv.contracts import PageLayout

    group = CPGroup.single()
    ops = kv_ops(group)
    fmt = _fmt(dtype, 8)
    fmts = [fmt.latent_only() if i in schedule else fmt for i in range(2)]
    ps, nl = fmt.page_size, fmt.latent_bytes_per_token
    pools = {lay: ShardedKVPool(fmts, 2, group, ops, pages_per_rank=16, layout=lay)
             for lay in PageLayout}
    g = torch.Generator().manual_seed(4)
    for batch in ([("a", 30), ("b", 13)], [("a", 5)]):
        lat = {ly: torch.randn(sum(n for _, n in batch), fmt.kv_lora_rank + fmt.rope_dim,
                              generator=g) for ly in range(2)}
        idx = {ly: torch.randn(sum(n for _, n in batch), fmt.index_head_dim, generator=g)
               for ly in range(2)}
        got = {}
        for lay, pool in pools.items():
            plan = plan_batch([pool.pages.request_spec(r, n) for r, n in batch], 1, ps)
            kv = pool.prepare(plan, [r for r, _ in batch])
            views = []
            for layer in range(2):
                pool.write(layer, kv, lat[layer], idx[layer] if fmts[layer].index_k else None)
                views.append(pool.materialize(layer, kv))
            top = torch.tensor([[0, 3, -1, 9], [12, 1, 2, -1]], dtype=torch.int32)
            got[lay] = [(v.latent(), v.index_k(), *v.keys(torch.float32),
                         *v.selected_latent(top, torch.float32)) for v in views]
            pool.commit(kv)
        for a, b in zip(got[PageLayout.TOKEN_MAJOR], got[PageLayout.PART_MAJOR], strict=True):
            assert all((x is None and y is None) or torch.equal(x, y)
                       for x, y in zip(a, b, strict=True))
    # the bytes of a part-major page: latent rows first, then index-K rows
    tok, part = pools[PageLayout.TOKEN_MAJOR], pools[PageLayout.PART_MAJOR]
    for layer in range(2):
        ni = fmts[layer].index_bytes_per_token
        assert part.store.kv[layer].shape[-1] == nl + ni
        for s_tok, s_part in zip(tok.pages.requests["a"].slots, part.pages.requests["a"].slots, strict=True):
            rows = tok.store.kv[layer][s_tok]  # [ps, nl + ni]
            block = part.store.kv[layer][s_part].reshape(-1)
            assert torch.equal(block[:ps * nl].view(ps, nl), rows[:, :nl])
            assert torch.equal(block[ps * nl:].view(ps, ni), rows[:, nl:])


def test_relayout_turns_token_major_blocks_into_part_major_pages() -> None:
    """A one-sided transfer copies a token-major pool's page blocks as they are; the part-major
    decode pool re-lays them out in place: its views then equal the sender's."""
    from cpkv.contracts import PageLayout

    group = CPGroup.single()
    ops = kv_ops(group)
    fmt = _fmt(KVDtype.FP8, 8)
    src = ShardedKVPool(fmt, 2, group, ops, pages_per_rank=6)
    dst = ShardedKVPool(fmt, 2, group, ops, pages_per_rank=6, layout=PageLayout.PART_MAJOR)
    for b in src.store.kv:
        b.random_(0, 255, generator=torch.Generator().manual_seed(5))
    pairs = [(0, 4), (3, 1), (5, 2)]  # (source slot, destination slot)
    for layer in range(2):
        for s, d in pairs:
            dst.store.kv[layer][d] = src.store.kv[layer][s]  # raw block copy, as Mooncake writes it
    untouched = dst.store.kv[0][0].clone()  # slot 0 is not among the relaid pages
    dst.store.relayout([d for _, d in pairs], PageLayout.TOKEN_MAJOR)
    for layer in range(2):
        for s, d in pairs:
            assert torch.equal(dst.store.latent[layer][d], src.store.latent[layer][s])
            assert torch.equal(dst.store.index_k[layer][d], src.store.index_k[layer][s])
    assert torch.equal(dst.store.kv[0][0], untouched)
