"""The CP-aware prefix cache: a radix tree of token ids over the sharded pool's pages (rule 28).

Every rank keeps one :class:`PrefixCache` over its pool and feeds it the same calls, so every
rank holds the same tree and makes the same decisions (hits, evictions) without communication.
The pages themselves stay where they are: on their owner rank, in its pool (rule 11). A hit
hands the new request the cached pages (shared, reference counted by the pool); when the hit
ends inside a page, the new request's head fragment would write into a page other requests
still read, so the pool copies that page on its owner first (copy on write, in
:meth:`~cpkv.kv.ShardedKVPool.prepare`), and the fragment runs on that owner (rule 3).

Keys past a request's valid length are never read: a full view holds exactly
``[0, prefix + extend)`` of each request (the tail page's rest is masked by construction).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import structlog

from cpkv.contracts import FallbackReason, cdiv
from cpkv.fallback import report_fallback
from cpkv.kv import ShardedKVPool

from .radix import PageRef, PrefixMatch, RadixTree

__all__ = ["CacheStats", "PrefixCache"]

log = structlog.get_logger(__name__)


@dataclass
class CacheStats:
    """Counters of one cache (identical on every rank)."""

    lookups: int = 0
    hit_tokens: int = 0
    looked_up_tokens: int = 0
    inserted_tokens: int = 0
    evicted_nodes: int = 0
    #: pages whose last reference went with an eviction (their slots are free again)
    pages_evicted: int = 0
    #: tokens a rank had cached but recomputed because another rank had less (rule 29)
    recomputed_tokens: int = 0


class PrefixCache:
    """Radix prefix cache over ``pool`` (see the module docstring).

    Args:
        pool: this rank's pool; the cache registers itself as the pool's page reclaimer, so a
            batch that does not fit evicts least recently used cached prefixes, then allocates.
    """

    def __init__(self, pool: ShardedKVPool) -> None:
        self.pool = pool
        self.tree = RadixTree(pool.fmt.page_size)
        self.stats = CacheStats()
        pool.reclaim = self.evict_for

    @property
    def page_size(self) -> int:
        return self.pool.fmt.page_size

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``tokens``, in tokens, leaving at least the last token to
        compute (its logits are the request's output)."""
        m = self.tree.match(tokens, limit=len(tokens) - 1)
        self.stats.lookups += 1
        self.stats.looked_up_tokens += len(tokens)
        self.stats.hit_tokens += m.hit_tokens
        return m

    def agree(self, match: PrefixMatch) -> PrefixMatch:
        """The hit every rank can serve: the minimum over ranks (rule 29; a collective, one host
        sync per request). Ranks fed the same calls agree already; a rank that has less (it lost
        a cached page) shortens every rank's hit, reported on every rank as fallback
        ``cache_hit_shortened``, and the rest is recomputed."""
        hit, neg_most = self.pool.group.agree_min([match.hit_tokens, -match.hit_tokens])
        if hit == -neg_most:  # every rank has the same hit
            return match
        report_fallback(op="prefix_cache", requested=f"cached prefix of up to {-neg_most} tokens",
                        selected=f"{hit} tokens (the shortest hit of any rank), the rest recomputed",
                        reason=FallbackReason.CACHE_HIT_SHORTENED,
                        detail=f"ranks could serve {hit} to {-neg_most} tokens; this rank "
                               f"{match.hit_tokens}")
        self.stats.hit_tokens -= match.hit_tokens - hit
        self.stats.recomputed_tokens += match.hit_tokens - hit
        if hit == match.hit_tokens:
            return match
        return PrefixMatch(hit_tokens=hit, pages=match.pages[:cdiv(hit, self.page_size)],
                           path=match.path)

    def attach(self, rid: Hashable, match: PrefixMatch) -> int:
        """Start request ``rid`` from the cached prefix ``match``: its page table takes the
        cached pages (shared) and its valid length the hit. Returns the hit length; the caller
        prefills the tokens after it. A zero hit attaches nothing.

        Raises:
            ValueError: ``rid`` is already in the pool.
        """
        if match.hit_tokens == 0:
            return 0
        self.pool.adopt(rid, match.pages, match.hit_tokens)
        self.tree.touch(match)
        return match.hit_tokens

    def insert(self, rid: Hashable, tokens: Sequence[int]) -> int:
        """Cache request ``rid``'s tokens: ``tokens`` are its token ids from position 0 (at least
        its valid length). The tree references its pages; the request keeps its own references
        until it is freed. Returns the tokens inserted (its valid length).

        Raises:
            ValueError: fewer tokens than the request's valid length, or it has an uncommitted
                batch.
        """
        rp = self.pool.table[rid]
        if rp.pending:
            raise ValueError(f"request {rid!r} has an uncommitted batch; insert after commit")
        n = rp.valid_len
        if len(tokens) < n:
            raise ValueError(f"request {rid!r} holds {n} tokens, {len(tokens)} token ids given")
        pages: list[PageRef] = [(rp.owners[k], rp.slots[k]) for k in range(cdiv(n, self.page_size))]
        self.pool.retain(self.tree.insert(tokens[:n], pages))
        self.stats.inserted_tokens += n
        return n

    def _evictable(self) -> list[int]:
        """Per allocation rank: pages that only the tree holds (what evicting everything frees)."""
        held: Counter[PageRef] = Counter(p for n in self.tree.nodes() for p in n.pages.values())
        out = [0] * self.pool.allocator.num_ranks
        for (owner, slot), n in held.items():
            if self.pool.refcount(owner, slot) == n:
                out[self.pool.alloc_rank(owner)] += 1
        return out

    def _evict_one(self) -> int | None:
        """Evict the least recently used prefix; the pages it freed, or None when empty."""
        dropped = self.tree.evict_one()
        if dropped is None:
            return None
        freed = self.pool.release(dropped)
        self.stats.evicted_nodes += 1
        self.stats.pages_evicted += freed
        return freed

    def evict_for(self, needs: Sequence[int]) -> bool:
        """Evict least recently used prefixes until every allocation rank has ``needs[a]`` free
        pages. Returns whether it got there (all ranks decide alike: the tree is the same). When
        even evicting everything would not make room, evicts nothing and returns False: the
        caller's error then leaves the cache as it was."""
        alloc = self.pool.allocator
        room = self._evictable()
        if any(alloc.free_pages(a) + room[a] < n for a, n in enumerate(needs)):
            return False
        while any(alloc.free_pages(a) < n for a, n in enumerate(needs)):
            if self._evict_one() is None:
                return False
        return True

    def evict(self, nodes: int) -> int:
        """Evict up to ``nodes`` least recently used prefixes; returns the pages freed."""
        freed = 0
        for _ in range(nodes):
            n = self._evict_one()
            if n is None:
                break
            freed += n
        return freed

    def clear(self) -> None:
        """Drop every cached prefix (pages no request holds go back to the free lists)."""
        while self._evict_one() is not None:
            pass

    def check_agreement(self) -> None:
        """Debug: every rank's tree is the same (a collective; syncs).

        Raises:
            RuntimeError: on every rank, when the trees differ.
        """
        if not self.pool.group.all_equal(self.tree.signature()):
            raise RuntimeError("debug: CP ranks' prefix caches disagree")
