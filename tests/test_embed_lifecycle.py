"""EngineKV's page lifecycle with the engine's allocator as the allocator: the given slots are
checked against the plan (owner, held, given twice), a prefix hit is one ``adopt`` before the
plan (its shared tail page copied on write by ``prepare``, into the first slot asked for), and
``free`` / ``release`` / ``abort`` return exactly the slots the engine's allocator takes back;
the row maps (each row's request, position, token index; each request's logits row); one
implementation of the per-batch lifecycle over the page table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.comm import CPGroup
from cpkv.contracts import KVFormat, RequestSpec, SplitMode
from cpkv.embed import (
    EngineKV,
    KVBufferSpec,
    hit_pages,
    key_ranges,
    logits_rows,
    read_pages,
)
from cpkv.planning import plan_batch
from cpkv.runtime.launch import run_ranks

PS = 8
FMT = KVFormat(dtype="fp32", page_size=PS, kv_lora_rank=8, rope_dim=4, index_head_dim=4)
ROOT = Path(__file__).resolve().parents[1]


class Slots:
    """An engine's allocator: per rank a free list, top-down."""

    def __init__(self, ranks: int, capacity: int) -> None:
        self.free = [list(range(capacity)) for _ in range(ranks)]

    def take(self, owner: int) -> tuple[int, int]:
        return owner, self.free[owner].pop()

    def give_back(self, pages: list[tuple[int, int]]) -> None:
        for o, s in pages:
            assert s not in self.free[o], f"slot {s} on rank {o} given back twice"
            self.free[o].append(s)


def _fill(kv: EngineKV, batch: object, value: int) -> None:
    """Every new row of the batch, every layer: bytes ``value``."""
    from cpkv.embed import EngineBatch

    assert isinstance(batch, EngineBatch)
    n = len(batch.ranges.position)
    for layer in range(kv.spec.num_layers):
        kv.put_bytes(layer, batch,
                     torch.full((n, FMT.latent_bytes_per_token), value, dtype=torch.uint8),
                     torch.full((n, FMT.index_bytes_per_token), value, dtype=torch.uint8))


def test_given_slots_are_checked_and_given_back_by_free_release_abort() -> None:
    g = CPGroup.single()
    spec = KVBufferSpec.allocate(FMT, 2, 12, "two_part")
    kv = EngineKV(spec, g)  # no op table: cpkv's torch page and row ops, no collective
    alloc = Slots(1, 12)
    plan = kv.plan([("a", 20)])
    owners = kv.owners_to_give(plan, ["a"])
    assert owners == {"a": (0, 0, 0)}
    pages = [alloc.take(o) for o in owners["a"]]
    with pytest.raises(ValueError, match="needs 3 pages"):
        kv.prepare(plan, ["a"], {"a": pages[:2]})
    with pytest.raises(ValueError):  # one slot twice
        kv.prepare(plan, ["a"], {"a": [pages[0], pages[0], pages[1]]})
    b = kv.prepare(plan, ["a"], {"a": pages})
    _fill(kv, b, 1)
    kv.commit(b)
    assert kv.valid_len("a") == 20 and kv.request_pages("a") == tuple(pages)
    # a slot cpkv still holds is refused (the engine's allocator gave it twice)
    plan = kv.plan([("b", 4)])
    with pytest.raises(ValueError):
        kv.prepare(plan, ["b"], {"b": [pages[0]]})
    # the engine's prefix cache holds a's pages; a finishes: nothing freed yet
    kv.retain(kv.request_pages("a"))
    assert kv.free("a") == []
    # a hit on 12 tokens (mid-page), adopted before the plan
    kv.adopt("c", hit_pages(12, [o for o, _ in pages], [s for _, s in pages], PS), 12)
    assert kv.valid_len("c") == 12
    plan = kv.plan([("c", 10)])
    assert plan.requests[0].prefix_len == 12
    owners = kv.owners_to_give(plan, ["c"])
    assert owners == {"c": (0, 0)}  # the tail page's copy, then page 2 (22 tokens)
    given = [alloc.take(o) for o in owners["c"]]
    bc = kv.prepare(plan, ["c"], {"c": given})
    assert [(k, old, new) for _, k, old, new in bc.copies] == [(1, pages[1][1], given[0][1])]
    for layer in range(2):  # the copy holds the tail page's bytes on every layer
        assert torch.equal(read_pages(spec, layer, torch.tensor([given[0][1]])),
                           read_pages(spec, layer, torch.tensor([pages[1][1]])))
    # aborted: exactly the slots given for the batch come back
    assert sorted(kv.abort(bc)) == sorted(given)
    alloc.give_back(given)
    assert kv.request_pages("c") == tuple(pages[:2])
    # the cache lets go: only the page c does not hold comes back; then c's
    assert kv.release(pages) == [pages[2]]
    assert sorted(kv.free("c")) == sorted(pages[:2])
    kv.close()


def _two_ranks(group: CPGroup) -> dict[str, object]:
    spec = KVBufferSpec.allocate(FMT, 1, 16, "two_part")
    kv = EngineKV(spec, group, fallback="error")
    alloc = Slots(2, 16)
    out: dict[str, object] = {}
    plan = kv.plan([("a", 32)])
    owners = kv.owners_to_give(plan, ["a"])["a"]
    out["owners_are_the_plans"] = list(owners) == list(plan.requests[0].page_owners)
    wrong = [(1 - o, alloc.free[1 - o][-1]) for o in owners]
    try:
        kv.prepare(plan, ["a"], {"a": wrong})
        out["wrong_owner_refused"] = False
    except ValueError as e:
        out["wrong_owner_refused"] = "the plan puts it on rank" in str(e)
    b = kv.prepare(plan, ["a"], {"a": [alloc.take(o) for o in owners]})
    kv.commit(b)
    from cpkv import FallbackError

    before = kv.request_pages("a")
    try:  # a short extend: token split and owner writes, refused under the policy "error"
        kv.prepare(kv.plan([("a", 3)]), ["a"], {})
        out["fallback_policy"] = False
    except FallbackError:
        out["fallback_policy"] = kv.request_pages("a") == before
    plan = kv.plan([("a", 32)])  # page-aligned, 2C pages: no fallback
    given = {r: [alloc.take(o) for o in os] for r, os in kv.owners_to_give(plan, ["a"]).items()}
    b2 = kv.prepare(plan, ["a"], given)
    out["after"] = len(b2.ranges.position) == 16 and kv.fallbacks == []
    out["abort"] = sorted(kv.abort(b2)) == sorted(given["a"])
    kv.close()
    return out


@pytest.mark.multiprocess
def test_owners_and_fallback_policy_on_two_ranks() -> None:
    results = run_ranks(_two_ranks, 2, timeout_s=120)
    for r in results:
        assert r.value and all(r.value.values()), (r.rank, r.value)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 50)), min_size=1, max_size=3),
       c=st.integers(1, 4), mode=st.sampled_from(list(SplitMode)))
def test_row_maps(lens: list[tuple[int, int]], c: int, mode: SplitMode) -> None:
    """Each local row's token index is its position in its request's new tokens; each request's
    logits row is, on the rank named, the row of its last new token; exactly one per request."""
    specs = [RequestSpec(prefix_len=p, extend_len=e,
                         prefix_owners=tuple(k % c for k in range(-(-p // PS))))
             for p, e in lens]
    plan = plan_batch(specs, c, PS, mode)
    lr = logits_rows(plan)
    for i, (p, e) in enumerate(lens):
        kr = key_ranges(plan, lr.rank[i])
        assert kr.request[lr.row[i]] == i and kr.position[lr.row[i]] == p + e - 1
    for r in range(c):
        kr = key_ranges(plan, r)
        for q, pos, tok in zip(kr.request, kr.position, kr.token, strict=True):
            assert tok == pos - lens[q][0] and 0 <= tok < lens[q][1]


def test_one_lifecycle_over_the_page_table() -> None:
    """The per-batch reservation over a PageTable is made in one place (ShardedKVPool.prepare),
    which EngineKV runs: no other module of the library reserves, commits or aborts batches."""
    src = ROOT / "core" / "src" / "cpkv"
    callers = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "reserve"  # PageTable.reserve: ``...pages.reserve``
                    and ast.unparse(node.func.value).endswith("pages")):
                callers.append(path.relative_to(src).as_posix())
    assert callers == ["kv/pool.py"]
    g = CPGroup.single()
    kv = EngineKV(KVBufferSpec.allocate(FMT, 1, 4, "two_part"), g)
    assert not [k for k, v in vars(kv).items() if type(v).__name__ == "PageTable"]
    kv.close()
