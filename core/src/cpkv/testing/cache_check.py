"""Checks of a prefix cache's bookkeeping against what holds its pages (tests and debug runs).

:func:`reference_problems` recounts every page reference from its holders: a device page is held
once per request page table and once per device tree node that lists it; a host page once per
host tree node and once per queued load. It also checks the tree's tier rule (a host node's
children are host nodes) and that every held slot is off the free lists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cpkv.cache import PrefixCache

if TYPE_CHECKING:
    import torch

    from cpkv.settings import Settings

__all__ = ["all_free", "common_prefix_len", "no_cache_logits", "no_cache_settings",
           "reference_problems"]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens ``a`` and ``b`` share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def no_cache_settings(settings: Settings, pages_per_rank: int = 256) -> Settings:
    """``settings`` for the tests' reference: one rank, no prefix cache, a pool of
    ``pages_per_rank`` pages."""
    return settings.with_cp_size(1).model_copy(
        update={"cache": settings.cache.model_copy(update={"enabled": False}),
                "kv": settings.kv.model_copy(update={"pages_per_rank": pages_per_rank})})


def no_cache_logits(model_dir: str, settings: Settings,
                    reqs: Sequence[tuple[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
    """Each request's last-token logits (float32, CPU) computed whole on one rank without a
    cache: what a cached CP run must equal."""
    from cpkv.comm import CPGroup
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    session = PrefillSession(load_model(model_dir), no_cache_settings(settings), CPGroup.single())
    out = {}
    for rid, toks in reqs:
        out[rid] = session.prefill([(rid, toks)]).last_logits[0].float().cpu()
        session.finish(rid)
    return out


def reference_problems(cache: PrefixCache) -> list[str]:
    """What is wrong with ``cache``'s reference counts (empty when nothing)."""
    pages, loads, host = cache.pages, cache.loads, cache.host
    dev: Counter[tuple[int, int]] = Counter()
    hst: Counter[tuple[int, int]] = Counter()
    for rp in pages.requests.values():
        dev.update((pages.alloc_rank(o), s) for o, s in zip(rp.owners, rp.slots, strict=True))
    problems: list[str] = []
    for n in cache.tree.nodes():
        refs = [(pages.alloc_rank(o), s) for o, s in n.pages.values()]
        (hst if n.on_host else dev).update(refs)
        if n.on_host and any(not c.on_host for c in n.children.values()):
            problems.append(f"host node [{n.start}, {n.end}) has a device child")
    for load in loads.queued_loads():
        hst.update((pages.alloc_rank(o), h) for o, h, _ in load.pages)
    held_refs = pages.references()
    if dict(dev) != held_refs:
        problems.append(f"device references {held_refs} != holders {dict(dev)}")
    if host is not None and dict(hst) != host.references():
        problems.append(f"host references {host.references()} != holders {dict(hst)}")
    if host is None and hst:
        problems.append("host nodes without a host tier")
    for a in range(pages.allocator.num_ranks):
        free = set(pages.allocator.snapshot()[a])
        held = {s for (r, s) in dev if r == a}
        if free & held:
            problems.append(f"rank {a}: held device slots on the free list: {sorted(free & held)}")
        if len(free) + len(held) != pages.allocator.capacity:
            problems.append(f"rank {a}: {len(free)} free + {len(held)} held != "
                            f"{pages.allocator.capacity} device slots")
        if host is not None:
            hfree = set(host.allocator.snapshot()[a])
            hheld = {s for (r, s) in hst if r == a}
            if hfree & hheld or len(hfree) + len(hheld) != host.capacity:
                problems.append(f"rank {a}: host free list {sorted(hfree)} vs held {sorted(hheld)}")
    return problems


def all_free(cache: PrefixCache) -> bool:
    """Every device and host slot is free (after every request was released and the cache
    cleared)."""
    pools = [cache.pages.allocator] + ([cache.host.allocator] if cache.host is not None else [])
    return all(p.free_pages(a) == p.capacity for p in pools for a in range(p.num_ranks))
