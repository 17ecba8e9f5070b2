"""The prefix cache's radix tree: token-valid hits, the right page for every part of a hit,
balanced page references (properties over random inserts, matches and evictions)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from cpkv.cache import RadixTree
from cpkv.cache.radix import PageRef
from cpkv.comm import CPGroup
from cpkv.fallback import recording
from cpkv.models import write_tiny_checkpoint
from cpkv.models.tiny import ARCHS
from cpkv.runtime import run_ranks
from cpkv.settings import load_settings
from cpkv.testing.cache_check import (
    all_free,
    common_prefix_len,
    no_cache_logits,
    reference_problems,
)

# few distinct tokens: shared prefixes and divergence inside pages are common
_seqs = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=40), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(_seqs, st.sampled_from([1, 3, 4, 8]), st.lists(st.integers(0, 2), max_size=40))
def test_hits_are_token_valid_and_pages_hold_the_hit(seqs: list[list[int]], ps: int,
                                                     query: list[int]) -> None:
    """The hit is the longest common prefix with any inserted sequence, in tokens (never floored
    to a page), and page k of the hit was written by a sequence that agrees with the query on
    every token of page k below the hit (so its bytes there are the query's KV)."""
    tree = RadixTree(ps)
    pages_of: dict[PageRef, tuple[int, int]] = {}  # page -> (sequence, logical page)
    for i, s in enumerate(seqs):
        pages = [(i, k) for k in range(-(-len(s) // ps))]
        pages_of.update({p: (i, k) for k, p in enumerate(pages)})
        tree.insert(s, pages)
    for q in [query, *seqs]:
        m = tree.match(q)
        want = max(common_prefix_len(q, s) for s in seqs)
        assert m.hit_tokens == want
        assert len(m.pages) == -(-want // ps)
        for k, page in enumerate(m.pages):
            writer, logical = pages_of[page]
            assert logical == k
            upto = min(want, (k + 1) * ps)
            assert seqs[writer][k * ps:upto] == q[k * ps:upto]
        limited = tree.match(q, limit=max(0, len(q) - 1))
        assert limited.hit_tokens == min(want, max(0, len(q) - 1))


@settings(max_examples=200, deadline=None)
@given(_seqs, st.sampled_from([1, 4, 8]), st.data())
def test_references_balance_through_eviction(seqs: list[list[int]], ps: int,
                                             data: st.DataObject) -> None:
    """Every page reference the tree adds (inserts, splits) is dropped again by evictions, and
    evicting everything leaves an empty tree; a match after partial eviction is still right."""
    tree = RadixTree(ps)
    held: Counter[PageRef] = Counter()
    for i, s in enumerate(seqs):
        held.update(tree.insert(s, [(i, k) for k in range(-(-len(s) // ps))]).device)
        if data.draw(st.booleans()):
            dropped = tree.evict_one()
            assert dropped is not None
            held.subtract(dropped)
            assert all(v >= 0 for v in held.values())
    while (dropped := tree.evict_one()) is not None:
        held.subtract(dropped)
    assert +held == Counter()
    assert tree.num_tokens() == 0 and tree.match(seqs[0]).hit_tokens == 0


def test_a_hit_ends_mid_page() -> None:
    """The issue's example: a prefix ending at token 70 with 64-token pages is a hit of 70 over
    two pages, the second taken from the sequence that wrote it."""
    tree = RadixTree(64)
    a = list(range(100))
    tree.insert(a, [(0, 10), (1, 11)])
    b = [*range(70), *(1000 + t for t in range(50))]
    m = tree.match(b)
    assert m.hit_tokens == 70 and m.pages == ((0, 10), (1, 11))
    # b diverges inside page 1 and brings its own copy of it: a later query that follows b
    # past token 70 must read b's page 1, one that follows a must read a's
    added = tree.insert(b, [(0, 10), (0, 20)])
    # b's node, and page 1 now in two nodes of a
    assert sorted(added.device) == [(0, 20), (1, 11)] and added.host == []
    assert tree.match([*b[:90], 7]).pages == ((0, 10), (0, 20))
    assert tree.match([*a[:90], 7]).pages == ((0, 10), (1, 11))
    assert tree.match([*a[:66], 7]).pages == ((0, 10), (1, 11))


def test_least_recently_used_leaf_goes_first() -> None:
    tree = RadixTree(4)
    tree.insert([1, 2, 3, 4, 5], [(0, 0), (0, 1)])
    tree.insert([7, 7, 7], [(1, 0)])
    tree.touch(tree.match([1, 2, 3, 4, 5]))
    assert tree.evict_one() == [(1, 0)]
    assert tree.match([1, 2, 3, 4, 5]).hit_tokens == 5


# ---- the cache over a real sharded pool: CP ranks (Gloo), a tiny DeepSeek-V3.2 checkpoint -------
PAGE = 8  # small pages: hits end inside pages often


def _scenario(seed: int, vocab: int = 512) -> list[tuple[str, list[int]]]:
    """Requests in arrival order: shared system prompts ending mid-page, a multi-turn follow-up
    (a later request extends an earlier one), an unrelated one, and exact repeats."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system, doc = toks(37), toks(29)  # 37 and 66 end inside 8-token pages
    a = system + toks(40)
    return [("a", a), ("b", system + toks(25)), ("c", system + doc + toks(17)),
            ("d", a + toks(1) + toks(21)), ("e", toks(30)), ("f", system + doc + toks(5)),
            ("g", list(a))]


def _held_rows(session: Any) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """The valid rows of each page a request or a cache node holds: per (owner, slot) of the
    pool, and per slot of this rank's host tier (a queued load's pages whole)."""
    pool, ps = session.pool, PAGE
    valid: dict[tuple[int, int], int] = {}

    def hold(owner: int, slot: int, rows: int) -> None:
        valid[(owner, slot)] = max(valid.get((owner, slot), 0), rows)

    for rp in pool.pages.requests.values():
        for k, (o, s) in enumerate(zip(rp.owners, rp.slots, strict=True)):
            hold(o, s, min(ps, rp.valid_len - k * ps))
    host_valid: dict[int, int] = {}
    for n in session.cache.tree.nodes():
        for k, (o, s) in n.pages.items():
            if not n.on_host:
                hold(o, s, min(ps, n.end - k * ps))
            elif pool.pages.alloc_rank(o) == pool.pages.alloc_rank(pool.group.rank):
                host_valid[s] = max(host_valid.get(s, 0), min(ps, n.end - k * ps))
    for load in pool.store.queued_loads():  # host pages still to be read by a queued load: whole pages
        for o, s, _ in load.pages:
            if pool.pages.alloc_rank(o) == pool.pages.alloc_rank(pool.group.rank):
                host_valid[s] = ps
    return valid, host_valid


def _poison_unheld(session: Any) -> int:
    """Write NaN bytes (0xFF) into every row of this rank's pool that no request and no cache node
    holds as valid: if anything read past a valid length, logits would turn NaN. Returns rows."""
    pool, ps, host = session.pool, PAGE, session.cache.host
    valid, host_valid = _held_rows(session)
    mine = pool.group.rank if pool.store.shared else None
    rows = 0
    for slot in range(pool.store.capacity):
        owner = pool.group.rank if mine is not None else 0
        keep = valid.get((owner, slot), 0) if mine is not None else max(
            (v for (o, s), v in valid.items() if s == slot), default=0)
        if keep < ps:
            for buf in pool.store.kv:
                buf[slot, keep:] = 0xFF
            rows += ps - keep
    for slot in range(host.capacity if host is not None else 0):
        keep = host_valid.get(slot, 0)
        if keep < ps:
            for buf in host.kv:
                buf[slot, keep:] = 0xFF
            rows += ps - keep
    return rows


def _serve(group: Any, model_dir: str, settings: Any, reqs: list[tuple[str, list[int]]],
           poison: bool, capture: bool = False) -> dict[str, Any]:
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    session = PrefillSession(load_model(model_dir), settings, group)
    out: dict[str, Any] = {"logits": {}, "hits": {}, "poisoned": 0}
    for rid, toks in reqs:
        hit = session.admit(rid, toks)
        if poison:
            out["poisoned"] += _poison_unheld(session)
        res = session.prefill([(rid, toks[hit:])], capture_topk=capture)
        out["logits"][rid] = res.last_logits[0].float().cpu()
        out["hits"][rid] = hit
        if res.topk is not None:
            out.setdefault("topk", {})[rid] = [t.cpu() for t in res.topk.indices]
        session.finish(rid, toks)
    assert session.cache is not None
    out["stats"] = dict(session.cache.stats.__dict__)
    out["signature"] = session.cache.tree.signature()
    out["problems"] = reference_problems(session.cache)
    session.cache.clear()
    session.pool.store.flush_loads()
    out["all_free"] = all_free(session.cache)
    out["refs_left"] = session.pool.pages.logical_pages()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}") / "ckpt", seed=5,
                                 **ARCHS[arch])


@pytest.mark.multiprocess
@pytest.mark.slow_on_arch("glm5")  # 10-13 CPU seconds each; v32 covers it in the fast subset
@pytest.mark.parametrize(("cp", "mode", "dtype", "pages", "host"), [
    pytest.param(2, "zigzag", "fp32", 256, 0, marks=pytest.mark.slow),  # 15 CPU seconds
    # fp8 with a big pool (10.5 CPU seconds): the fast subset has fp8 with the host tier below
    pytest.param(2, "interleave", "fp8", 256, 0, marks=pytest.mark.slow),
    # a pool too small to keep every finished request: later batches evict, least recent first
    pytest.param(2, "zigzag", "bf16", 14, 0, id="2-zigzag-bf16-evicting"),
    # the same, with a host tier that keeps what the pool evicts: every hit as with a big pool
    pytest.param(2, "interleave", "fp8", 9, 64, id="2-interleave-fp8-host"),
    pytest.param(4, "zigzag", "bf16", 5, 64, id="4-zigzag-bf16-host", marks=pytest.mark.slow),
    pytest.param(4, "interleave", "bf16", 256, 0, marks=pytest.mark.slow),
])
def test_cache_hits_equal_a_no_cache_single_rank_run(tiny: Path, cp: int, mode: str, dtype: str,
                                                     pages: int, host: int) -> None:
    """Requests served one by one on C ranks, each starting from the longest cached prefix (hits
    in tokens, ending inside pages), with every pool row no one holds poisoned before each
    batch (host tier rows too): logits equal one rank without a cache; every rank holds the
    same tree; after the cache is cleared every page is free again."""
    reqs = _scenario(cp)
    s = load_settings(cp={"size": cp, "mode": mode},
                      kv={"page_size": PAGE, "dtype": dtype, "pages_per_rank": pages},
                      cache={"host_pages": host}, backend={"preference": ["torch"]}, debug=True)
    with recording():
        results = run_ranks(_serve, cp, args=(str(tiny), s, reqs, True), timeout_s=300)
    ref = no_cache_logits(str(tiny), s, reqs)
    r0 = results[0].value
    tol = {"fp32": 1e-4, "bf16": 1e-3, "fp8": 2e-2}[dtype]
    for rid, _ in reqs:
        a, b = r0["logits"][rid], ref[rid]
        rel = ((a - b).abs().amax() / b.abs().amax()).item()
        assert rel <= tol, f"{rid}: logits differ from the no-cache run by {rel:.2e}"
    hits = r0["hits"]
    assert hits["b"] == 37 and hits["c"] == 37 and hits["e"] == 0  # token-valid, mid-page
    if pages > 100 or host:  # nothing lost: the follow-ups hit their whole earlier request
        assert hits["d"] == len(reqs[0][1]) and hits["f"] == 66 and hits["g"] == len(reqs[0][1]) - 1
    if pages > 100:
        assert r0["stats"]["pages_evicted"] == 0
    else:
        assert r0["stats"]["pages_evicted"] > 0
    # with a host tier, evicted prefixes came back from it
    assert (r0["stats"]["pages_loaded_from_host"] > 0) == bool(host)
    assert r0["poisoned"] > 0
    assert len({r.value["signature"] for r in results}) == 1
    assert all(r.value["all_free"] and r.value["refs_left"] == 0 for r in results)
    assert all(r.value["problems"] == [] for r in results)


@pytest.mark.multiprocess
@pytest.mark.slow  # 11-13 CPU seconds
def test_poisoned_rows_change_no_logit_and_no_topk_choice(tiny: Path) -> None:
    """The same requests through the cache (evicting, hits mid-page) twice on the same ranks,
    once with every unheld row poisoned before each batch: every logit and every layer's top-k
    choice of every computed token is bit for bit the same."""
    reqs = _scenario(2)
    s = load_settings(cp={"size": 2, "mode": "zigzag"},
                      kv={"page_size": PAGE, "dtype": "bf16", "pages_per_rank": 14},
                      cache={"host_pages": 16}, backend={"preference": ["torch"]})
    runs = [run_ranks(_serve, 2, args=(str(tiny), s, reqs, p, True), timeout_s=300)[0].value
            for p in (False, True)]
    clean, dirty = runs
    assert dirty["poisoned"] > 0 and clean["poisoned"] == 0
    assert clean["hits"] == dirty["hits"] and clean["hits"]["b"] == 37
    for rid, _ in reqs:
        assert torch.equal(clean["logits"][rid], dirty["logits"][rid]), rid
        assert len(clean["topk"][rid]) > 0
        for a, b in zip(clean["topk"][rid], dirty["topk"][rid], strict=True):
            assert torch.equal(a, b), rid


# ---- random programs of serve / keep / release / evict across ranks ---------------------------
@st.composite
def _programs(draw: st.DrawFn) -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """Ops over requests whose tokens share random prefixes of a few roots (ending anywhere in
    a page): ("serve", [req]) admit+prefill+finish; ("pair", [r1, r2]) both in one batch;
    ("keep", [req]) admit+prefill, cached later by ("release", [req]); ("evict", []) one
    least recently used prefix."""
    roots = draw(st.lists(st.lists(st.integers(0, 5), min_size=8, max_size=40), min_size=1,
                          max_size=2))

    def request(i: int) -> tuple[str, list[int]]:
        root = draw(st.sampled_from(roots))
        cut = draw(st.integers(0, len(root)))
        tail = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
        return f"r{i}", root[:cut] + tail

    ops: list[tuple[str, list[tuple[str, list[int]]]]] = []
    kept: list[tuple[str, list[int]]] = []
    for i in range(draw(st.integers(3, 8))):
        kind = draw(st.sampled_from(["serve", "serve", "pair", "keep", "release", "evict"]))
        if kind == "release" and kept:
            ops.append(("release", [kept.pop(0)]))
        elif kind == "keep" and len(kept) < 2:
            kept.append(request(i))
            ops.append(("keep", [kept[-1]]))
        elif kind == "pair":
            ops.append(("pair", [request(i), (f"r{i}b", request(i)[1])]))
        elif kind == "evict":
            ops.append(("evict", []))
        else:
            ops.append(("serve", [request(i)]))
    return ops


def _run_program(group: Any, model_dir: str, settings: Any,
                 ops: list[tuple[str, list[tuple[str, list[int]]]]]) -> dict[str, Any]:
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    session = PrefillSession(load_model(model_dir), settings, group)
    assert session.cache is not None
    start = [sorted(f) for f in session.pool.pages.allocator.snapshot()]
    logits: dict[str, Any] = {}
    hits: dict[str, int] = {}
    for kind, reqs in ops:
        if kind == "evict":
            session.cache.evict(1)
            continue
        if kind == "release":
            rid, toks = reqs[0]
            session.finish(rid, toks)
            continue
        for rid, toks in reqs:
            hits[rid] = session.admit(rid, toks)
        res = session.prefill([(rid, toks[hits[rid]:]) for rid, toks in reqs])
        for j, (rid, _) in enumerate(reqs):
            logits[rid] = res.last_logits[j].float().cpu()
        if kind != "keep":
            for rid, toks in reqs:
                session.finish(rid, toks)
    for rid in list(session.pool.pages.requests):  # kept and never released: dropped uncached
        session.finish(rid)
    signature = session.cache.tree.signature()
    session.cache.clear()
    return {"logits": logits, "hits": hits, "signature": signature,
            "restored": [sorted(f) for f in session.pool.pages.allocator.snapshot()] == start
            and session.pool.pages.logical_pages() == 0}


@pytest.mark.multiprocess
@pytest.mark.slow  # 3 programs x (C ranks + a reference) per case
@pytest.mark.parametrize(("cp", "mode", "dtype", "pages"), [
    (2, "zigzag", "fp32", 24), (2, "interleave", "fp8", 256), (4, "zigzag", "bf16", 24),
    (4, "interleave", "fp32", 256),
])
@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.generate])
@given(ops=_programs())
def test_random_programs_match_a_no_cache_run_and_give_every_page_back(
        tiny: Path, cp: int, mode: str, dtype: str, pages: int,
        ops: list[tuple[str, list[tuple[str, list[int]]]]]) -> None:
    s = load_settings(cp={"size": cp, "mode": mode},
                      kv={"page_size": PAGE, "dtype": dtype, "pages_per_rank": pages},
                      backend={"preference": ["torch"]}, debug=True)
    with recording():
        results = run_ranks(_run_program, cp, args=(str(tiny), s, ops), timeout_s=300)
    r0 = results[0].value
    reqs = [(rid, toks) for kind, rs in ops if kind in ("serve", "pair", "keep") for rid, toks in rs]
    ref = no_cache_logits(str(tiny), s, reqs)
    tol = {"fp32": 1e-4, "bf16": 1e-3, "fp8": 2e-2}[dtype]
    for rid, toks in reqs:
        a, b = r0["logits"][rid], ref[rid]
        rel = ((a - b).abs().amax() / b.abs().amax()).item()
        assert rel <= tol, f"{rid} (hit {r0['hits'][rid]} of {len(toks)}): {rel:.2e}"
        assert 0 <= r0["hits"][rid] < len(toks)
    assert len({r.value["signature"] for r in results}) == 1
    assert all(r.value["restored"] for r in results)


# ---- the pool under the cache: pressure, abort after a copy on write, eviction order ----------
def _small_pool(pages: int) -> tuple[Any, Any]:
    from cpkv.cache import PrefixCache
    from cpkv.contracts import KVDtype, KVFormat
    from cpkv.kv import ShardedKVPool
    from cpkv.ops import OpTable
    from cpkv.plugin import PluginHost

    host = PluginHost()
    try:
        ops = OpTable.resolve(host.backends(), ["torch"])
    finally:
        host.close()
    fmt = KVFormat(dtype=KVDtype.BF16, page_size=4, kv_lora_rank=64, rope_dim=16,
                   index_head_dim=32, quant_block=32)
    pool = ShardedKVPool(fmt, 1, CPGroup.single(), ops, pages_per_rank=pages)
    return pool, PrefixCache(pool.pages, pool.store, pool.group)


def _cached(pool: Any, cache: Any, rid: str, toks: list[int]) -> None:
    from cpkv.planning import plan_batch

    pool.commit(pool.prepare(plan_batch([pool.pages.request_spec(rid, len(toks))], 1, 4), [rid]))
    cache.insert(rid, toks)
    pool.pages.free(rid)


def test_a_batch_that_cannot_fit_leaves_the_cache_alone() -> None:
    from cpkv.kv import PoolExhausted
    from cpkv.planning import plan_batch

    pool, cache = _small_pool(5)
    _cached(pool, cache, "a", list(range(12)))
    before = (cache.tree.signature(), pool.pages.allocator.snapshot())
    with pytest.raises(PoolExhausted, match="needs 10 pages, has 2 free"):
        pool.prepare(plan_batch([pool.pages.request_spec("z", 40)], 1, 4), ["z"])
    assert (cache.tree.signature(), pool.pages.allocator.snapshot()) == before
    assert cache.stats.evicted_nodes == 0


def test_abort_after_pressure_freed_the_shared_tail_page() -> None:
    """The tail page was shared when the batch was planned; making room evicted its other
    holder, so it is written in place (no copy), and abort gives back exactly the new pages."""
    from cpkv.planning import plan_batch

    pool, cache = _small_pool(5)
    a = list(range(12))
    _cached(pool, cache, "a", a)
    b = a[:5] + [100 + i for i in range(8)]
    hit = cache.attach("b", cache.match(b))
    held = {rid: (list(rp.slots), rp.valid_len) for rid, rp in pool.pages.requests.items()}
    batch = pool.prepare(plan_batch([pool.pages.request_spec("b", len(b) - hit)], 1, 4), ["b"])
    assert hit == 5 and cache.stats.pages_evicted > 0 and batch.copies == ()
    pool.abort(batch)
    assert {rid: (list(rp.slots), rp.valid_len) for rid, rp in pool.pages.requests.items()} == held
    pool.pages.free("b")
    cache.clear()
    assert pool.pages.allocator.free_pages(0) == 5 and pool.pages.logical_pages() == 0


def test_a_split_keeps_the_unused_rest_older() -> None:
    """After b's insert splits a's node, the rest of a (which b did not use) is older than b's
    new leaf: it goes first."""
    tree = RadixTree(8)
    a = list(range(77))
    b = a[:37] + [1000 + i for i in range(25)]
    tree.insert(a, [(k % 2, k) for k in range(10)])
    tree.insert(b, [(k % 2, 100 + k) for k in range(8)])
    assert tree.evict_one() == [(0, 4), (1, 5), (0, 6), (1, 7), (0, 8), (1, 9)]  # a's pages 4..9


def _serve_with_short_rank(group: Any, model_dir: str, settings: Any,
                           reqs: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """Rank 1 can serve at most 40 tokens of any cached prefix (as if it lost the pages past
    them); the other ranks have the whole hit."""
    if group.rank == 1:
        from cpkv.cache import radix

        full = radix.RadixTree.match

        def short(self: Any, tokens: Any, limit: int | None = None) -> Any:
            return full(self, tokens, 40 if limit is None else min(limit, 40))

        radix.RadixTree.match = short  # type: ignore[method-assign]
    return _serve(group, model_dir, settings, reqs, False)


@pytest.mark.multiprocess
@pytest.mark.slow  # 8.5 CPU seconds
def test_every_rank_uses_the_shortest_hit_and_says_so(tiny: Path) -> None:
    reqs = _scenario(2)
    s = load_settings(cp={"size": 2, "mode": "interleave"}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]})
    with recording():
        results = run_ranks(_serve_with_short_rank, 2, args=(str(tiny), s, reqs), timeout_s=300)
    ref = no_cache_logits(str(tiny), s, reqs)
    for r in results:
        hits = r.value["hits"]
        assert hits["d"] == 40 and hits["b"] == 37  # min(77 on rank 0, 40 on rank 1); 37 < 40
        for rid, _ in reqs:
            a, b = r.value["logits"][rid], ref[rid]
            assert ((a - b).abs().amax() / b.abs().amax()).item() <= 1e-4, rid
        shortened = [e for e in r.fallbacks if e.reason.value == "cache_hit_shortened"]
        assert shortened and all(e.op == "prefix_cache" for e in shortened)
        assert r.value["stats"]["recomputed_tokens"] == (77 - 40 + 66 - 40 + 76 - 40
                                                         if r.rank == 0 else 0)


# ---- poisoned rows and the transfer to a decode rank -------------------------------------------
def _poisoning_disagg(world: Any, spec: Any, poison: bool) -> Any:
    """The disaggregated job (C prefill ranks + a decode rank); with ``poison``, every prefill
    rank poisons the rows no one holds as valid before each batch."""
    from cpkv.runtime.job import disagg_rank
    from cpkv.runtime.session import PrefillSession

    if poison and world.rank < spec.settings.cp.size:
        plain = PrefillSession.prefill

        def poisoned(self: Any, batch: Any, **kw: Any) -> Any:
            assert _poison_unheld(self) > 0
            return plain(self, batch, **kw)

        PrefillSession.prefill = poisoned  # type: ignore[method-assign]
    return disagg_rank(world, spec)


@pytest.mark.slow  # 5.4 s per architecture on 2 cores
@pytest.mark.multiprocess
def test_poisoned_rows_change_no_valid_transferred_byte(tiny: Path) -> None:
    """Prompts served through the cache (hits ending mid-page, copies on write) and sent to a
    decode rank, once with every unheld row poisoned on the prefill ranks: the decode rank
    receives the same valid bytes (per-page CRC of the valid rows), and decodes the same tokens
    as a single rank without a cache."""
    from dataclasses import replace

    from cpkv.runtime.job import JobSpec, reference_rank

    reqs = _scenario(2)
    prompts = tuple(tuple(t) for _, t in reqs[:4])
    s = load_settings(cp={"size": 2, "mode": "zigzag"},
                      kv={"page_size": PAGE, "dtype": "bf16", "pages_per_rank": 64},
                      backend={"preference": ["torch"]}, debug=True,
                      transfer={"name": "nccl", "timeout_s": 60}, run={"batch_size": 1})
    spec = JobSpec(str(tiny), prompts, s, False, (), 4, batch_size=1)
    runs = {p: run_ranks(_poisoning_disagg, 3, args=(spec, p), timeout_s=300) for p in (False, True)}
    clean, dirty = runs[False][2].value, runs[True][2].value
    assert dirty.valid_crcs == clean.valid_crcs and len(clean.valid_crcs) == len(prompts)
    assert dirty.page_crcs != clean.page_crcs  # the tails did carry poison: it was never read
    with recording():
        _, ref_tokens = reference_rank(replace(spec, settings=s.with_cp_size(1)))
    assert dirty.tokens == clean.tokens == ref_tokens
    hits = runs[True][0].value.prefill.hits
    assert hits[1] == 37 and hits[2] == 37 and hits[3] == len(prompts[0])
