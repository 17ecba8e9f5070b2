"""A radix tree over token ids whose nodes hold the KV pages that store their tokens (rule 28).

Hits are counted in **tokens**: a cached prefix that ends at token 70 with 64-token pages is a
hit of 70, and its pages are the two that cover it (the second valid for 6 tokens). Physical
coverage stays page-aligned; the valid length is what the tree reports.

A node covers absolute tokens ``[start, end)`` of every sequence through it and holds, for each
logical page k that overlaps that span, a :data:`PageRef` (owner rank, physical slot) whose bytes
are valid for page k at least up to ``end``. A page that straddles a node boundary therefore
appears in two nodes: in the upper one it is valid up to the boundary, and the lower node may
hold the same page (one request inserted both) or a different one (a request that diverged
inside the page wrote its own copy of it). For a hit of ``h`` tokens, page k comes from the
deepest node on the path that holds token ``min(h, (k + 1) * ps) - 1``.

A node is on the device (its refs are device pool slots) or on the host (``on_host``: its refs
are host tier slots, after an eviction backed it up). A host node's descendants are host nodes:
a request whose hit runs through host nodes brings them back first.

The tree is host metadata, deterministic, and fed the same calls on every rank, so every rank
holds the same tree. It never touches device memory: it tells its owner (the cache) which pages
it starts and stops referencing, and the owner keeps the reference counts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["Inserted", "PageRef", "PrefixMatch", "RadixTree"]

#: one physical page: (owner rank, slot on that rank's pool)
PageRef = tuple[int, int]


@dataclass(eq=False)
class _Node:
    start: int
    tokens: tuple[int, ...]
    pages: dict[int, PageRef]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_use: int = 0
    #: the pages are host tier slots (backed up by an eviction), not device pool slots
    on_host: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence.

    Attributes:
        hit_tokens: matched tokens (may end inside a page).
        pages: the pages covering them, page 0 first (``ceil(hit_tokens / ps)`` of them).
        path: the matched nodes, root side first (for :meth:`RadixTree.touch`).
    """

    hit_tokens: int
    pages: tuple[PageRef, ...]
    path: tuple[_Node, ...] = ()

    @property
    def on_host(self) -> tuple[_Node, ...]:
        """The matched nodes whose pages are on the host (they are loaded back before use)."""
        return tuple(n for n in self.path if n.on_host)


@dataclass(frozen=True)
class Inserted:
    """The page references an insert added: device pool pages, and host tier pages (a split
    of a host node shares its straddling page between the two halves)."""

    device: list[PageRef]
    host: list[PageRef]


class RadixTree:
    """Token-id radix tree with page references (see the module docstring).

    Args:
        page_size: tokens per page.

    The methods that add or drop page references return them as lists (one entry per reference
    added or dropped); :class:`~cpkv.cache.prefix.PrefixCache` keeps the counts.
    """

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = _Node(start=0, tokens=(), pages={}, parent=None)
        self._clock = 0

    # ---- lookup ------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` (at most ``limit`` tokens), in tokens."""
        cap = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos = self.root, 0
        path: list[_Node] = []
        while pos < cap:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = 0
            for a, b in zip(child.tokens, tokens[pos:cap], strict=False):
                if a != b:
                    break
                n += 1
            path.append(child)
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return self.prefix(tuple(path), pos)

    def prefix(self, path: Sequence[_Node], hit: int) -> PrefixMatch:
        """The match of the first ``hit`` tokens along ``path`` (a match's path, or its start)."""
        path = tuple(n for n in path if n.start < hit)
        return PrefixMatch(hit_tokens=hit, pages=tuple(r for _, r in self.page_sources(path, hit)),
                           path=path)

    def page_sources(self, path: Sequence[_Node], hit: int) -> list[tuple[_Node, PageRef]]:
        """For each page of a hit of ``hit`` tokens along ``path``: the node it is read from
        (the deepest that holds the page's last hit token) and its reference."""
        ps, out = self.page_size, []
        i = 0
        for k in range(-(-hit // ps)):
            last = min(hit, (k + 1) * ps) - 1
            while path[i].end <= last:
                i += 1
            out.append((path[i], path[i].pages[k]))
        return out

    def touch(self, match: PrefixMatch) -> None:
        """Mark the matched nodes used now (least recently used nodes are evicted first)."""
        self._clock += 1
        for n in match.path:
            n.last_use = self._clock

    # ---- insertion ---------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[PageRef]) -> Inserted:
        """Cache ``tokens`` stored in device ``pages`` (``ceil(len(tokens) / ps)`` of them,
        page 0 first). Tokens the tree already holds keep the tree's pages (host nodes among them
        stay on the host: :meth:`promote` swaps them for the request's pages). Returns the page
        references the tree added (a page once per node that now holds it).

        Raises:
            ValueError: ``pages`` does not cover ``tokens``.
        """
        ps = self.page_size
        if len(pages) != -(-len(tokens) // ps):
            raise ValueError(f"{len(tokens)} tokens need {-(-len(tokens) // ps)} pages of {ps}, "
                             f"got {len(pages)}")
        added = Inserted(device=[], host=[])
        m = self.match(tokens)
        hit = m.hit_tokens
        parent = self.root
        used = list(m.path)
        if m.path:
            last = m.path[-1]
            if hit < last.end:
                (added.host if last.on_host else added.device).extend(self.split(last, hit))
                assert last.parent is not None  # the upper part of the split, ending at ``hit``
                parent = used[-1] = last.parent  # the rest of ``last`` was not used by this insert
            else:
                parent = last
        self._clock += 1
        for n in used:
            n.last_use = self._clock
        if hit < len(tokens):
            span = range(hit // ps, -(-len(tokens) // ps))
            node = _Node(start=hit, tokens=tuple(tokens[hit:]), pages={k: pages[k] for k in span},
                         parent=parent)
            parent.children[tokens[hit]] = node
            added.device.extend(node.pages.values())
            node.last_use = self._clock
        return added

    def split(self, node: _Node, at: int) -> list[PageRef]:
        """Cut ``node`` at absolute token ``at``: a new upper node [start, at) takes its place,
        the node keeps [at, end). Returns the page references added (a straddling page)."""
        ps = self.page_size
        cut = at - node.start
        upper_pages = {k: r for k, r in node.pages.items() if k * ps < at}
        upper = _Node(start=node.start, tokens=node.tokens[:cut], pages=upper_pages,
                      parent=node.parent, last_use=node.last_use, on_host=node.on_host)
        assert node.parent is not None
        node.parent.children[node.tokens[0]] = upper
        lower_pages = {k: r for k, r in node.pages.items() if (k + 1) * ps > at}
        added = [r for k, r in lower_pages.items() if k in upper_pages]
        node.start, node.tokens, node.pages, node.parent = at, node.tokens[cut:], lower_pages, upper
        upper.children[node.tokens[0]] = node
        return added

    # ---- eviction ----------------------------------------------------------------------------
    def nodes(self) -> Iterator[_Node]:
        """Every node but the root (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    def leaves(self) -> Iterator[_Node]:
        return (n for n in self.nodes() if not n.children)

    def lru(self, on_host: bool, keep: Collection[_Node] = ()) -> _Node | None:
        """The least recently used node that can leave its tier, not in ``keep``: a device
        node with no device child (``on_host=False``), or a host leaf. Ties break by position
        in the tree (deterministic)."""
        best: _Node | None = None
        for n in self.nodes():
            if n.on_host != on_host or n in keep:
                continue
            if any(on_host or not c.on_host for c in n.children.values()):
                continue
            if best is None or (n.last_use, n.start, n.tokens) < (best.last_use, best.start,
                                                                   best.tokens):
                best = n
        return best

    def remove(self, node: _Node) -> list[_Node]:
        """Take ``node`` and everything below it out of the tree; returns those nodes (their
        page references are dropped: the caller releases them, each in its node's tier)."""
        assert node.parent is not None
        del node.parent.children[node.tokens[0]]
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict_one(self) -> list[PageRef] | None:
        """Remove the least recently used leaf; returns its page references (dropped), or None
        when the tree is empty. Ties break by position in the tree (deterministic). A request
        that still uses the leaf's pages holds its own references: eviction only forgets them."""
        best: _Node | None = None
        for n in self.leaves():
            if best is None or (n.last_use, n.start, n.tokens) < (best.last_use, best.start,
                                                                   best.tokens):
                best = n
        if best is None:
            return None
        assert best.parent is not None
        del best.parent.children[best.tokens[0]]
        return list(best.pages.values())

    def num_tokens(self) -> int:
        """Tokens held in the tree (sum over nodes)."""
        return sum(len(n.tokens) for n in self.nodes())

    def signature(self) -> str:
        """A canonical text of the whole tree (token runs, pages, use order): equal on every rank
        that was fed the same calls (the debug switch compares it across ranks)."""
        out: list[str] = []

        def walk(n: _Node, depth: int) -> None:
            for key in sorted(n.children):
                c = n.children[key]
                out.append(f"{depth}:{c.start}:{c.tokens}:{sorted(c.pages.items())}:{c.last_use}"
                           f"{':host' if c.on_host else ''}")
                walk(c, depth + 1)

        walk(self.root, 0)
        return "\n".join(out)
