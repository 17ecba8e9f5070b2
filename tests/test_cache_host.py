"""The prefix cache's host tier: evicted prefixes backed up on their owners' host memory and
loaded back on a hit (bit-exact), host LRU drops, a lost host page shortening every rank's hit,
and the eviction setting."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from cpkv.cache import PrefixCache
from cpkv.comm import CPGroup
from cpkv.contracts import KVDtype, KVFormat
from cpkv.kv import PoolExhausted, ShardedKVPool
from cpkv.kv.host import HostPages
from cpkv.planning import plan_batch
from cpkv.runtime import run_ranks
from cpkv.testing.cache_check import all_free, no_cache_logits, reference_problems
from cpkv.testing.pool_check import kv_ops

PS = 4
FMT = KVFormat(dtype=KVDtype.BF16, page_size=PS, kv_lora_rank=64, rope_dim=16, index_head_dim=32,
               quant_block=32)


DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _pool(pages: int, host_pages: int | None, layers: int = 2,
          device: str = "cpu") -> tuple[ShardedKVPool, PrefixCache]:
    group = CPGroup.single(torch.device(device))
    pool = ShardedKVPool(FMT, layers, group, kv_ops(group), pages_per_rank=pages)
    host = None if host_pages is None else HostPages(FMT, layers, host_pages, 1, pool.group.device)
    return pool, PrefixCache(pool.pages, pool.store, pool.group, host)


def _fill(pool: ShardedKVPool, rid: str, toks: list[int], hit: int) -> None:
    """Prefill ``toks[hit:]`` for ``rid``: every layer's new rows get bytes that encode (layer,
    token id, position), so a page's content tells which tokens it holds."""
    batch = pool.prepare(plan_batch([pool.pages.request_spec(rid, len(toks) - hit)], 1, PS), [rid])
    rp = pool.pages.requests[rid]
    for layer in range(pool.num_layers):
        pool.prefetch(layer, batch)
        batch.stage.ready(layer)
        for p in range(hit, len(toks)):
            pool.store.kv[layer][rp.slots[p // PS], p % PS] = (layer * 7 + toks[p] * 3 + p) % 251
    pool.commit(batch)


def _expect_bytes(pool: ShardedKVPool, rid: str, toks: list[int]) -> None:
    rp = pool.pages.requests[rid]
    for layer in range(pool.num_layers):
        for p in range(rp.valid_len):
            got = pool.store.kv[layer][rp.slots[p // PS], p % PS]
            want = (layer * 7 + toks[p] * 3 + p) % 251
            assert bool((got == want).all()), f"layer {layer} position {p} of {rid} is wrong"


def _serve(pool: ShardedKVPool, cache: PrefixCache, rid: str, toks: list[int]) -> int:
    hit = cache.attach(rid, cache.agree(cache.match(toks)))
    _fill(pool, rid, toks, hit)
    _expect_bytes(pool, rid, toks)  # the hit's pages (some loaded from the host) hold its tokens
    cache.insert(rid, toks)
    pool.pages.free(rid)
    assert reference_problems(cache) == []
    return hit


@pytest.mark.parametrize("device", DEVICES)
def test_host_round_trip_is_bit_exact(device: str) -> None:
    """Pages saved to scattered host slots and loaded into other device slots come back byte
    for byte (every layer, latent and index-K columns together)."""
    pool, _ = _pool(8, None, layers=3, device=device)
    host = HostPages(FMT, 3, 6, 1, pool.group.device)
    assert host.kv[0].is_pinned() == (device == "cuda")
    g = torch.Generator().manual_seed(0)
    for buf in pool.store.kv:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    before = [buf.clone() for buf in pool.store.kv]
    host.save(pool.store.kv, host.index([1, 2, 6]), host.index([5, 0, 1]), pool.store.ops)
    dst = torch.tensor([7, 3, 0], device=device)
    for layer in range(3):
        host.load(layer, pool.store.kv[layer], host.index([5, 0, 1]), dst, pool.store.ops)
        for d, s in zip([7, 3, 0], [1, 2, 6], strict=True):
            assert torch.equal(pool.store.kv[layer][d], before[layer][s])
        assert torch.equal(pool.store.kv[layer][4], before[layer][4])  # nothing else moved


@pytest.mark.parametrize("device", DEVICES)
def test_an_evicted_prefix_comes_back_from_the_host(device: str) -> None:
    """A pool of 6 pages keeps one 20-token request at a time: the others are evicted to the
    host, and a later hit through them loads them back (bytes checked), including a hit that
    ends inside a host node (only the hit comes back) and inside a page (copied on write). On
    a GPU the loads and copies run a layer ahead on the pool's side stream."""
    pool, cache = _pool(6, 32, device=device)
    a = list(range(20))
    b = [50 + t for t in range(20)]
    assert _serve(pool, cache, "a", a) == 0
    assert _serve(pool, cache, "b", b) == 0  # a's 5 pages went to the host to make room
    assert cache.stats.pages_saved_to_host == 5 and cache.stats.pages_evicted == 5
    assert [n.on_host for n in cache.tree.nodes()].count(True) == 1
    # 10 tokens of a: a hit inside a's host node (mid-page), then new tokens
    c = [*a[:10], 200, 201, 202, 203, 204]
    assert _serve(pool, cache, "c", c) == 10
    assert cache.stats.pages_loaded_from_host == 3  # pages 0-2 only; a's rest stays on the host
    # the rest of a is still on the host and comes back for the whole of a
    assert _serve(pool, cache, "a2", [*a, 7]) == 20
    assert cache.stats.pages_loaded_from_host > 3
    cache.clear()
    pool.store.flush_loads()
    assert all_free(cache) and reference_problems(cache) == []


def test_the_host_tier_drops_its_least_recently_used_prefix() -> None:
    pool, cache = _pool(5, 5)
    seqs = {r: [100 * i + t for t in range(16)] for i, r in enumerate("abcd")}
    for rid, toks in seqs.items():  # 4 pages each; a 5-page pool and a 5-page host tier
        _serve(pool, cache, rid, toks)
    assert cache.stats.host_pages_dropped > 0
    # a and b were dropped from the host (oldest), c is on the host, d on the device
    assert cache.match(seqs["a"]).hit_tokens == 0 and cache.match(seqs["b"]).hit_tokens == 0
    assert cache.match(seqs["c"] + [1]).hit_tokens == 16
    assert _serve(pool, cache, "c2", seqs["c"] + [1]) == 16
    cache.clear()
    assert all_free(cache)


def test_without_room_to_load_the_hit_stops_at_the_device_part() -> None:
    """Loading the host part needs more pages than the pool can free (a running request holds
    the rest): the hit is the device part, reported as ``cache_hit_shortened``."""
    from cpkv.fallback import recording

    pool, cache = _pool(6, 32)
    a = list(range(20))
    _serve(pool, cache, "a", a)
    cache.evict(10)  # a to the host
    hold = [300 + t for t in range(17)]  # a running request holds 5 of the 6 pages
    _fill(pool, "hold", hold, 0)
    with recording() as events:
        m = cache.agree(cache.match([*a, 1]))
        assert cache.attach("x", m) == 0
    assert [e.reason.value for e in events.events] == ["cache_hit_shortened"]
    assert "no room to load 5 host pages" in events.events[0].detail
    assert reference_problems(cache) == []


def test_a_lost_host_page_stops_the_hit_before_it() -> None:
    from cpkv.fallback import recording

    pool, cache = _pool(6, 32)
    a = list(range(20))
    _serve(pool, cache, "a", a)
    cache.evict(10)
    assert cache.host is not None
    node = next(iter(cache.tree.nodes()))
    cache.host.lost.add(node.pages[2][1])  # logical page 2: tokens 8-11
    with recording() as events:
        assert _serve(pool, cache, "b", [*a, 1]) == 8
    assert [e.reason.value for e in events.events] == ["host_page_missing"]
    # b's insert replaced the host node by b's own device pages: the loss is healed
    assert _serve(pool, cache, "c", [*a, 2]) == 20
    cache.clear()
    pool.store.flush_loads()
    assert all_free(cache)


def test_eviction_none_keeps_cached_prefixes() -> None:
    pool = ShardedKVPool(FMT, 1, CPGroup.single(), kv_ops(CPGroup.single()), pages_per_rank=5)
    cache = PrefixCache(pool.pages, pool.store, pool.group, evict=False)
    _serve(pool, cache, "a", list(range(12)))
    before = (cache.tree.signature(), pool.pages.allocator.snapshot())
    with pytest.raises(PoolExhausted):
        pool.prepare(plan_batch([pool.pages.request_spec("z", 12)], 1, PS), ["z"])
    assert (cache.tree.signature(), pool.pages.allocator.snapshot()) == before


def test_host_tier_must_match_the_pool() -> None:
    pool, _ = _pool(4, None)
    with pytest.raises(ValueError, match="allocation ranks"):
        PrefixCache(pool.pages, pool.store, pool.group, HostPages(FMT, 2, 4, 2, pool.group.device))
    with pytest.raises(ValueError, match=">= 1 page"):
        HostPages(FMT, 2, 0, 1, pool.group.device)





# ---- across CP ranks -----------------------------------------------------------------------
def _lose_and_serve(group: Any, model_dir: str, settings: Any,
                    reqs: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """Serve the first request, evict everything to the host, then rank 1 loses every host page
    it owns; serve the rest."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    session = PrefillSession(load_model(model_dir), settings, group)
    cache = session.cache
    assert cache is not None and cache.host is not None
    out: dict[str, Any] = {"logits": {}, "hits": {}}
    for i, (rid, toks) in enumerate(reqs):
        hit = out["hits"][rid] = session.admit(rid, toks)
        out["logits"][rid] = session.prefill([(rid, toks[hit:])]).last_logits[0].float().cpu()
        session.finish(rid, toks)
        if i == 0:
            cache.evict(100)
            if group.rank == 1:
                cache.host.lost.update(range(cache.host.capacity))
    out["stats"] = dict(cache.stats.__dict__)
    out["problems"] = reference_problems(cache)
    cache.clear()
    session.pool.store.flush_loads()
    out["all_free"] = all_free(cache)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cpkv.models import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=5)


@pytest.mark.multiprocess
def test_a_rank_that_lost_host_pages_makes_every_rank_use_the_shorter_hit(tiny: Path) -> None:
    from cpkv.fallback import recording
    from cpkv.settings import load_settings

    rng = random.Random(3)
    a = [rng.randrange(512) for _ in range(45)]
    reqs = [("a", a), ("b", a + [rng.randrange(512) for _ in range(9)])]
    s = load_settings(cp={"size": 2, "mode": "interleave"},
                      kv={"page_size": 8, "dtype": "fp32", "pages_per_rank": 32},
                      cache={"host_pages": 32}, backend={"preference": ["torch"]}, debug=True)
    with recording():
        results = run_ranks(_lose_and_serve, 2, args=(str(tiny), s, reqs), timeout_s=300)
    ref = no_cache_logits(str(tiny), s, reqs)
    for r in results:
        v = r.value
        # interleave: rank 1 owns page 1 (tokens 8-15), so its hit stops at 8; rank 0 had 45
        assert v["hits"]["b"] == 8 and v["problems"] == [] and v["all_free"]
        for rid, _ in reqs:
            x, y = v["logits"][rid], ref[rid]
            assert ((x - y).abs().amax() / y.abs().amax()).item() <= 1e-4, rid
        reasons = [e.reason.value for e in r.fallbacks if e.op == "prefix_cache"]
        assert reasons == (["host_page_missing", "cache_hit_shortened"] if r.rank == 1
                           else ["cache_hit_shortened"])
        assert v["stats"]["recomputed_tokens"] == (45 - 8 if r.rank == 0 else 0)
