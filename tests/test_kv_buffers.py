"""Issue 37: KV buffers given by the caller (cpkv.kv.buffers) and the page table's external
allocation mode (PageTable.reserve(given=...)).

Every layout round-trips bit-exactly: packed rows written into one layout, moved as canonical
pages into any other (a transfer, the host tier and back), read back as the same bytes; the
two-part index-K page is DeepGEMM's order (all values, then all scales) byte for byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.contracts import KVFormat, SplitMode
from cpkv.kv import PageTable
from cpkv.kv.buffers import (
    BufferLayout,
    KVBufferSpec,
    index_split,
    read_pages,
    read_part,
    read_rows,
    region_bytes,
    write_pages,
    write_part,
    write_rows,
)
from cpkv.planning import plan_batch

FMTS = {
    "fp8": KVFormat(dtype="fp8", page_size=8, kv_lora_rank=32, rope_dim=8, index_head_dim=16,
                    quant_block=16),
    "fp32": KVFormat(dtype="fp32", page_size=8, kv_lora_rank=16, rope_dim=8, index_head_dim=8),
}
LAYOUTS = list(BufferLayout)


def _rows(fmt: KVFormat, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, fmt.latent_bytes_per_token), generator=g, dtype=torch.uint8),
            torch.randint(0, 256, (n, fmt.index_bytes_per_token), generator=g, dtype=torch.uint8))


@settings(max_examples=25, deadline=None)
@given(fmt_name=st.sampled_from(sorted(FMTS)), src=st.sampled_from(LAYOUTS),
       dst=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16), n=st.integers(1, 20))
def test_rows_round_trip_through_pages_between_any_layouts(fmt_name: str, src: BufferLayout,
                                                           dst: BufferLayout, seed: int,
                                                           n: int) -> None:
    fmt = FMTS[fmt_name]
    cap = 6
    a = KVBufferSpec.allocate(fmt, 2, cap, src)
    b = KVBufferSpec.allocate(fmt, 2, cap, dst)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(cap * fmt.page_size, generator=g)[:n]
    lat, idx = _rows(fmt, n, seed)
    write_rows(a, 1, rows, lat, idx)
    got_l, got_i = read_rows(a, 1, rows)
    assert torch.equal(got_l, lat) and got_i is not None and torch.equal(got_i, idx)
    # pages move as canonical blocks (transfer, host tier): to other slots of another layout
    slots = torch.arange(cap)
    moved = torch.flip(slots, [0])
    blocks = read_pages(a, 1, slots)
    assert blocks.shape == (cap, fmt.page_size, fmt.bytes_per_token)
    write_pages(b, 1, moved, blocks.clone())  # a host copy, then back
    ps = fmt.page_size
    there = (cap - 1 - rows // ps) * ps + rows % ps
    back_l, back_i = read_rows(b, 1, there)
    assert torch.equal(back_l, lat) and back_i is not None and torch.equal(back_i, idx)
    assert torch.equal(read_pages(b, 1, moved), blocks)
    assert not read_pages(b, 0, slots).any()  # another layer untouched


@pytest.mark.parametrize("src", LAYOUTS)
@pytest.mark.parametrize("dst", LAYOUTS)
def test_latent_only_layers_round_trip(src: BufferLayout, dst: BufferLayout) -> None:
    """A shared-indexer layer (no index-K, helper B's per-layer formats) moves its latent only."""
    fmt = FMTS["fp8"]
    fmts = [fmt, fmt.latent_only()]
    a, b = KVBufferSpec.allocate(fmts, 2, 4, src), KVBufferSpec.allocate(fmts, 2, 4, dst)
    assert not a.has_index_k(1) and a.fmt == fmt
    lat, _ = _rows(fmt, 5, 3)
    rows = torch.tensor([0, 3, 9, 17, 30])
    write_rows(a, 1, rows, lat, None)
    blocks = read_pages(a, 1, torch.arange(4))
    assert blocks.shape == (4, fmt.page_size, fmt.latent_bytes_per_token)
    write_pages(b, 1, torch.arange(4), blocks)
    got, idx = read_rows(b, 1, rows)
    assert idx is None and torch.equal(got, lat)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt_name", sorted(FMTS))
def test_parts_and_regions_of_every_layout(layout: BufferLayout, fmt_name: str) -> None:
    """A part's token rows (``read_part``: what the packed transfer layout and the receiver
    move) are the rows ``write_rows`` stored, in every layout; ``write_part`` puts them back
    into another pool of any layout; the page regions (what whole-page movers copy) are the
    spec's own tensors with ``region_bytes`` each, a latent-only layer's the latent only."""
    fmt = FMTS[fmt_name]
    fmts = [fmt, fmt.latent_only()]
    spec = KVBufferSpec.allocate(fmts, 2, 4, layout)
    for k in range(2):
        regs = spec.regions(k)
        assert [int(r.shape[1]) for r in regs] == list(region_bytes(fmts[k], layout))
        assert [r.data_ptr() for r in regs] == [t.data_ptr() for t in spec.layers[k].parts()]
        assert sum(int(r.shape[1]) for r in regs) == fmts[k].page_bytes
    ps = fmt.page_size
    lat, idx = _rows(fmt, 2 * ps, 7)
    slots = torch.tensor([3, 1])
    rows = (slots[:, None] * ps + torch.arange(ps)).reshape(-1)
    write_rows(spec, 0, rows, lat, idx)
    got_l = read_part(spec, 0, "latent", slots)
    got_i = torch.empty(2, ps, fmt.index_bytes_per_token, dtype=torch.uint8)
    assert read_part(spec, 0, "index_k", slots, out=got_i) is got_i
    assert torch.equal(got_l.reshape(-1, fmt.latent_bytes_per_token), lat)
    assert torch.equal(got_i.reshape(-1, fmt.index_bytes_per_token), idx)
    assert read_part(spec, 1, "index_k", slots).shape == (2, ps, 0)  # no index-K part
    for other in LAYOUTS:
        b = KVBufferSpec.allocate(fmts, 2, 4, other)
        write_part(b, 0, "latent", torch.tensor([0, 2]), got_l)
        write_part(b, 0, "index_k", torch.tensor([0, 2]), got_i)
        assert torch.equal(read_pages(b, 0, torch.tensor([0, 2])), read_pages(spec, 0, slots))


def test_two_part_index_k_page_is_deepgemm_order() -> None:
    fmt = FMTS["fp8"]
    ps, (vb, sb) = fmt.page_size, index_split(fmt)
    assert (vb, sb) == (16, 4)
    spec = KVBufferSpec.allocate(fmt, 1, 3, "two_part")
    lat, idx = _rows(fmt, ps, 1)
    write_rows(spec, 0, 2 * ps + torch.arange(ps), lat, idx)
    ik = spec.layers[0].index_k
    assert ik is not None and ik.shape == (3, ps * (vb + sb))
    page = ik[2]
    assert torch.equal(page[: ps * vb].view(ps, vb), idx[:, :vb])  # all values first
    assert torch.equal(page[ps * vb:].view(ps, sb), idx[:, vb:])  # then every scale
    lt = spec.layers[0].latent
    assert lt is not None and torch.equal(lt[2], lat)  # latent rows as FlashMLA reads them
    assert not ik[:2].any() and not lt[:2].any()


def test_wrap_uses_the_callers_tensors_and_checks_them() -> None:
    fmt = FMTS["fp8"]
    ps = fmt.page_size
    latent = torch.zeros(4, ps, fmt.latent_bytes_per_token, dtype=torch.uint8)
    index_k = torch.zeros(4, ps * fmt.index_bytes_per_token, dtype=torch.uint8)
    spec = KVBufferSpec.wrap(fmt, "two_part", [(latent, index_k), (latent.clone(), None)])
    assert spec.layers[0].latent is latent and spec.layers[0].index_k is index_k
    assert spec.has_index_k(0) and not spec.has_index_k(1)
    lat, idx = _rows(fmt, 3, 2)
    rows = torch.tensor([0, 9, 31])
    write_rows(spec, 0, rows, lat, idx)
    assert latent.view(-1, fmt.latent_bytes_per_token)[rows].equal(lat)  # written in place
    with pytest.raises(ValueError, match="without index-K"):
        write_rows(spec, 1, rows, lat, idx)
    write_rows(spec, 1, rows, lat, None)
    assert spec.fmts[1] == fmt.latent_only()  # no index-K tensor: a latent-only layer
    assert read_pages(spec, 1, torch.arange(4)).shape == (4, ps, fmt.latent_bytes_per_token)
    with pytest.raises(ValueError, match="layer 0 latent must be a contiguous uint8"):
        KVBufferSpec.wrap(fmt, "two_part", [(latent.float(), index_k)])
    with pytest.raises(ValueError, match="layer 0 kv must be"):
        KVBufferSpec.wrap(fmt, "token_major", [torch.zeros(4, ps, 7, dtype=torch.uint8)])


# ---- external allocation ------------------------------------------------------------------------
def test_reserve_takes_the_engines_slots_and_refuses_wrong_ones() -> None:
    ps, c = 4, 2
    table = PageTable(ps, c, 32)
    plan = plan_batch([(0, 30)], c, ps, SplitMode.INTERLEAVE)
    owners = plan.requests[0].page_owners
    assert list(owners) == [0, 1, 0, 1, 0, 1, 0, 1]
    # vLLM / SGLang style: page k on rank k mod C, at the engine's own slot ids
    pages = [(o, 10 + k) for k, o in enumerate(owners)]
    before = table.allocator.snapshot()
    with pytest.raises(ValueError, match=r"given page 1 is on rank 0, the plan puts it on rank 1"):
        table.reserve(plan, ["a"], given={"a": [(0, 10), (0, 11), *pages[2:]]})
    with pytest.raises(ValueError, match=r"needs 8 pages .* 7 were given"):
        table.reserve(plan, ["a"], given={"a": pages[:7]})
    with pytest.raises(ValueError, match="out of range or not free"):
        table.reserve(plan, ["a"], given={"a": [*pages[:7], (1, 99)]})
    with pytest.raises(ValueError, match="given twice"):
        table.reserve(plan, ["a"], given={"a": [*pages[:7], (1, 11)]})
    with pytest.raises(ValueError, match="not in the batch"):
        table.reserve(plan, ["a"], given={"a": pages, "b": []})
    assert table.allocator.snapshot() == before and not table.requests  # nothing changed
    res = table.reserve(plan, ["a"], given={"a": pages})
    table.commit(res)
    assert table.requests["a"].slots == [s for _, s in pages]
    assert table.requests["a"].owners == list(owners)
    assert table.refcount(0, 10) == 1 and table.allocator.free_pages(0) == 28
    # a slot held already is refused; another request's plan gets the free ones
    plan_b = plan_batch([(0, 8)], c, ps, SplitMode.INTERLEAVE)
    with pytest.raises(ValueError, match="not free"):
        table.reserve(plan_b, ["b"], given={"b": [(0, 10), (1, 0)]})
    table.commit(table.reserve(plan_b, ["b"], given={"b": [(0, 0), (1, 0)]}))


def test_reserve_given_copy_on_write_slot_comes_first() -> None:
    ps, c = 4, 2
    table = PageTable(ps, c, 16)
    plan = plan_batch([(0, 6)], c, ps, SplitMode.INTERLEAVE)
    table.commit(table.reserve(plan, ["a"], given={"a": [(0, 3), (1, 5)]}))
    table.adopt("b", [(0, 3), (1, 5)], 6)  # a prefix hit ending mid-page: page 1 is shared
    spec = table.request_spec("b", 5)
    plan_b = plan_batch([spec], c, ps, SplitMode.INTERLEAVE)
    # b writes into its tail page (rank 1's slot 5): a copy on rank 1 first, then page 2 (rank 0)
    with pytest.raises(ValueError, match="a copy of its shared tail page"):
        table.reserve(plan_b, ["b"], given={"b": [(0, 7)]})
    res = table.reserve(plan_b, ["b"], given={"b": [(1, 9), (0, 7)]})
    assert res.copies == (("b", 1, 5, 9),)
    table.commit(res)
    assert table.requests["b"].slots == [3, 9, 7] and table.requests["a"].slots == [3, 5]
