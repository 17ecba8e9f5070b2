"""Rank functions that exercise the sharded pool against a replicated one (used by the
multi-process tests and by GPU runs). Each returns plain data for the parent to assert on."""

from __future__ import annotations

import copy
import hashlib
import random
import zlib
from dataclasses import dataclass, field

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import CPPlan, KVFormat, SplitMode, cdiv, pages_nbytes
from cpkv.kv import PageLoad, PoolExhausted, ShardedKVPool, pack_rows
from cpkv.kv.buffers import read_pages
from cpkv.kv.host import HostPages
from cpkv.ops import KV_OPS, OpTable
from cpkv.planning import plan_batch
from cpkv.plugin import PluginHost

__all__ = [
    "PoolOutcome",
    "PoolScenario",
    "kv_ops",
    "page_share_bound",
    "random_batches",
    "run_pool_scenario",
    "run_pool_scenarios",
    "truth_rows",
]


@dataclass(frozen=True)
class PoolScenario:
    """Batches of (request id, extend length), run in order; requests continue across batches."""

    batches: tuple[tuple[tuple[str, int], ...], ...]
    fmt: KVFormat
    mode: SplitMode = SplitMode.ZIGZAG
    num_layers: int = 2
    pages_per_rank: int = 256
    seed: int = 0
    debug: bool = False
    #: backend preference for the KV ops (the registry reports every step away from the first)
    preference: tuple[str, ...] = ("torch",)
    #: the sharded pool's materialization ("all_gather" or "p2p")
    materialize: str = "all_gather"
    #: layers that cache no index-K (GLM-5's shared-indexer layers): latent-only formats
    shared_layers: tuple[int, ...] = ()
    #: both pools' layout (``BufferLayout`` value: token_major, part_major, two_part)
    layout: str = "token_major"

    @property
    def fmts(self) -> tuple[KVFormat, ...]:
        """The pool's format per layer."""
        return tuple(self.fmt.latent_only() if i in self.shared_layers else self.fmt
                     for i in range(self.num_layers))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer."""
        return pages_nbytes(self.fmts, 1)


@dataclass
class PoolOutcome:
    rank: int
    mismatches: list[str] = field(default_factory=list)
    bytes_held: int = 0
    replica_bytes_held: int = 0
    logical_bytes: int = 0
    #: per request: pages this rank owns, pages in total
    pages: dict[str, tuple[int, int]] = field(default_factory=dict)
    exhausted: list[str] = field(default_factory=list)
    unchanged_after_exhaustion: bool = True
    views_checked: int = 0
    materialize_mode: str = ""
    prefetched_views: int = 0
    #: per request, per logical page this rank owns: CRC32 of its canonical blocks over every
    #: layer (``read_pages``: the same bytes in every layout)
    page_crcs: dict[str, dict[int, int]] = field(default_factory=dict)
    #: this rank's pages saved to a host tier, wiped, loaded back: the canonical bytes unchanged
    host_round_trip: bool = False


def truth_rows(seed: int, rid: str, layers: int, length: int, dim: int) -> torch.Tensor:
    """Deterministic KV rows [layers, length, dim] of a request, identical on every rank."""
    h = int.from_bytes(hashlib.sha256(f"{seed}/{rid}/{dim}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(h)
    return torch.randn(layers, length, dim, generator=g)


def kv_ops(group: CPGroup, preference: tuple[str, ...] = ("torch",)) -> OpTable:
    """The KV op table of ``preference``, agreed across the group's ranks."""
    host = PluginHost()
    try:
        return OpTable.resolve(host.backends(), preference, KV_OPS, agree=group.agree_all)
    finally:
        host.close()


def _scenario_truth(sc: PoolScenario,
                    device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per request of ``sc``, its true latent and index-K rows [layers, tokens, dim] on
    ``device``, as long as all its batches together."""
    fmt = sc.fmt
    longest: dict[str, int] = {}
    for b in sc.batches:
        for rid, e in b:
            longest[rid] = longest.get(rid, 0) + e
    dl, di = fmt.kv_lora_rank + fmt.rope_dim, fmt.index_head_dim
    return {rid: (truth_rows(sc.seed, rid, sc.num_layers, n, dl).to(device),
                  truth_rows(sc.seed, rid, sc.num_layers, n, di).to(device))
            for rid, n in longest.items()}


def _wanted(truth: dict[str, tuple[torch.Tensor, torch.Tensor]], rids: list[str], plan: CPPlan,
            layer: int, fmt: KVFormat, ops: OpTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored bytes a full view of ``layer`` must hold: (latent, index-K; no index bytes for
    a latent-only layer)."""
    reqs = list(zip(rids, plan.requests, strict=True))
    want_l = pack_rows(torch.cat([truth[r][0][layer, : q.end] for r, q in reqs]), fmt, "latent",
                       ops)
    want_i = pack_rows(torch.cat([truth[r][1][layer, : q.end] for r, q in reqs]),
                       fmt.with_index(), "index_k", ops)
    return want_l, want_i if fmt.index_k else want_i[:, :0]


def run_pool_scenario(group: CPGroup, sc: PoolScenario) -> PoolOutcome:
    """Run every batch on a sharded and a replicated pool; compare full views bit for bit."""
    ops = kv_ops(group, sc.preference)
    ps = sc.fmt.page_size
    # the replica is the reference: give it room for every page, so only the sharded pool can
    # run out (a replica needs C times the pages of a shard)
    pools = {shared: ShardedKVPool(sc.fmts, sc.num_layers, group, ops, shared=shared,
                                   pages_per_rank=sc.pages_per_rank * (1 if shared else group.size),
                                   debug=sc.debug, layout=sc.layout,
                                   materialize=sc.materialize if shared else "all_gather")
             for shared in (True, False)}
    out = PoolOutcome(rank=group.rank, materialize_mode=pools[True].store.views.mode)
    truth = _scenario_truth(sc, group.device)
    for bi, batch_reqs in enumerate(sc.batches):
        rids = [r for r, _ in batch_reqs]
        views = {}
        before = {s: (p.pages.allocator.snapshot(), copy.deepcopy(dict(p.pages.requests)))
                  for s, p in pools.items()}
        batches = {}
        try:
            # one plan for both pools: the replica's page table has the same owners
            specs = [pools[True].pages.request_spec(r, e) for r, e in batch_reqs]
            plan = plan_batch(specs, group.size, ps, sc.mode)
            for shared, pool in pools.items():
                batches[shared] = pool.prepare(plan, rids)
        except PoolExhausted as exc:
            out.exhausted.append(f"batch {bi}: {exc}")
            for shared, bk in batches.items():
                pools[shared].abort(bk)
            for s, p in pools.items():
                if (p.pages.allocator.snapshot(), dict(p.pages.requests)) != before[s]:
                    out.unchanged_after_exhaustion = False
            continue
        for layer in range(sc.num_layers):
            lfmt = sc.fmts[layer]
            lat = torch.cat([truth[r][0][layer, q.prefix_len:q.end] for r, q in
                             zip(rids, plan.requests, strict=True)])
            idx = torch.cat([truth[r][1][layer, q.prefix_len:q.end] for r, q in
                             zip(rids, plan.requests, strict=True)])
            for shared, pool in pools.items():
                bk = batches[shared]
                pool.write(layer, bk, bk.split(lat), bk.split(idx) if lfmt.index_k else None)
                views[shared] = pool.materialize(layer, bk)
            split = batches[True].materialize_split
            if split is not None:  # the prefetched path must give the same view
                pf = pools[True].prefetch(layer, batches[True])
                v2 = pools[True].materialize(layer, batches[True], pf)
                if not (torch.equal(v2.latent(), views[True].latent())
                        and torch.equal(v2.index_k(), views[True].index_k())):
                    out.mismatches.append(f"batch {bi} layer {layer}: prefetched view differs")
                out.prefetched_views += pf is not None
            want_l, want_i = _wanted(truth, rids, plan, layer, lfmt, ops)
            for name, (got, ref) in {
                "sharded latent vs replicated": (views[True].latent(), views[False].latent()),
                "sharded index_k vs replicated": (views[True].index_k(), views[False].index_k()),
                "sharded latent vs truth": (views[True].latent(), want_l),
                "sharded index_k vs truth": (views[True].index_k(), want_i),
            }.items():
                if got.shape != ref.shape or not torch.equal(got, ref):
                    out.mismatches.append(f"batch {bi} layer {layer}: {name}")
            out.views_checked += 1
        for shared, pool in pools.items():
            pool.commit(batches[shared])
    sharded = pools[True]
    # every rank is done reading views (p2p reads its peers' pages in place) before any wipes
    # its pages for the host-tier round trip: without it a slow rank's last prefetched view
    # read a peer's wiped pages (seen once under load, "prefetched view differs")
    group.barrier()
    _pages_out(sharded, group, out)
    foot = sharded.footprint()
    out.bytes_held = foot.bytes_held
    out.replica_bytes_held = pools[False].footprint().bytes_held
    out.logical_bytes = foot.replicated_bytes
    for key, rp in sharded.pages.requests.items():
        # the scenario's request ids are strings (the pool keys any hashable)
        out.pages[str(key)] = (sum(1 for o in rp.owners if o == group.rank), len(rp.owners))
    return out


def _canonical(pool: ShardedKVPool, slots: list[int]) -> list[torch.Tensor]:
    """Per layer, the canonical blocks of pages ``slots`` (uint8 [n, ps, B] on the host)."""
    store = pool.store
    idx = torch.tensor(slots, dtype=torch.int64, device=store.group.device)
    return [read_pages(store.spec, k, idx).cpu() for k in range(store.num_layers)]


def _pages_out(pool: ShardedKVPool, group: CPGroup, out: PoolOutcome) -> None:
    """The canonical CRC of each page this rank owns (``out.page_crcs``), then a host-tier round
    trip of them (saved, their device regions wiped, loaded back with the staged page work):
    ``out.host_round_trip`` when every byte came back."""
    mine: list[tuple[str, int, int]] = []
    for key, rp in pool.pages.requests.items():
        for k, (o, slot) in enumerate(zip(rp.owners, rp.slots, strict=True)):
            if o == group.rank:
                mine.append((str(key), k, slot))
    if not mine:
        out.host_round_trip = True
        return
    slots = [s for _, _, s in mine]
    before = _canonical(pool, slots)
    for i, (rid, k, _) in enumerate(mine):
        data = b"".join(b[i].numpy().tobytes() for b in before)
        out.page_crcs.setdefault(rid, {})[k] = zlib.crc32(data)
    alloc = pool.pages.alloc_rank(group.rank)
    store = pool.store
    host = HostPages(store.fmts, store.num_layers, len(slots), pool.pages.allocator.num_ranks,
                     store.group.device, store.spec.layout)
    needs = [len(slots) if a == alloc else 0 for a in range(host.allocator.num_ranks)]
    hs = host.take(needs)[alloc]
    store.save_to_host(host, slots, hs)
    idx = torch.tensor(slots, dtype=torch.int64, device=store.group.device)
    for regs in store.regions:
        for r in regs:
            r.index_fill_(0, idx, 0)
    store.queue_load(PageLoad(host, tuple((group.rank, h, d)
                                          for h, d in zip(hs, slots, strict=True))))
    store.flush_loads()
    after = _canonical(pool, slots)
    out.host_round_trip = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def page_share_bound(outcome_pages: dict[str, tuple[int, int]], cp: int,
                     page_bytes: int, layers: int) -> int:
    """Rule 11's bound on one rank's bytes: per request ceil(pages / C) + 1 pages."""
    return sum((cdiv(n, cp) + 1) * page_bytes * layers for _, n in outcome_pages.values())


def random_batches(rng: random.Random, max_extend: int,
                   num_batches: int = 3) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Batches of 1-4 requests with mixed lengths; later batches continue earlier requests,
    so prefixes often end inside a page."""
    out: list[tuple[tuple[str, int], ...]] = []
    names: list[str] = []
    for _ in range(num_batches):
        batch: dict[str, int] = {}
        for _ in range(rng.randint(1, 4)):
            rid = rng.choice(names) if names and rng.random() < 0.5 else f"r{len(names)}"
            if rid not in names:
                names.append(rid)
            batch[rid] = rng.choice([rng.randint(1, 8), rng.randint(1, max_extend)])
        out.append(tuple(batch.items()))
    return tuple(out)


def run_pool_scenarios(group: CPGroup, scenarios: list[PoolScenario]) -> list[PoolOutcome]:
    """Several scenarios in one launch (spawning ranks costs seconds on a small machine)."""
    return [run_pool_scenario(group, sc) for sc in scenarios]
