"""Prefill -> decode transfer (contract rules 25-27): transfer plans, the receiver's publish
rules, the NCCL plugin over Gloo with C = 2 and 4 prefill ranks, chunked prefill, faults."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.comm import CPGroup
from cpkv.contracts import cdiv
from cpkv.disagg import (
    Ack,
    DecodeReceiver,
    DecodeTransfer,
    Grant,
    Offer,
    RankTransfer,
    StoreSideChannel,
    TransferError,
    TransferManifest,
    TransferRefused,
    coalesce,
    link_features,
    manifest_for,
    pack_part,
    part_nbytes,
    registered_buffers,
)
from cpkv.kv import PoolExhausted, RequestPages
from cpkv.models import load_model, write_tiny_checkpoint
from cpkv.runtime import RankFailed, run_ranks
from cpkv.runtime.job import DecodeReport, JobSpec, SenderReport, disagg_rank
from helpers import (
    PAGE,
    FakeRank,
    check_landed,
    deliver,
    fake_source,
    job_spec,
    next_request_works,
    pool_snapshot,
    receiver_of,
    reference_tokens,
    small_format,
    torch_pool,
    transfer_pages,
)

# ---- transfer plans ----------------------------------------------------------------------------

@st.composite
def page_tables(draw: Any) -> tuple[int, list[int], list[int], int]:
    c = draw(st.integers(1, 4))
    n = draw(st.integers(0, 40))
    owners = draw(st.lists(st.integers(0, c - 1), min_size=n, max_size=n))
    # per-rank slots: consecutive with random gaps, so some runs coalesce and some do not
    nxt = [draw(st.integers(0, 5)) for _ in range(c)]
    slots = []
    for o in owners:
        slots.append(nxt[o])
        nxt[o] += 1 + draw(st.sampled_from([0, 0, 0, 1, 3]))
    return c, owners, slots, n


@settings(max_examples=300, deadline=None)
@given(page_tables(), st.integers(1, 16), st.booleans(), st.data())
def test_manifest_runs_cover_owned_pages_once(table: Any, ps: int, final: bool, data: Any) -> None:
    c, owners, slots, n = table
    valid = data.draw(st.integers(max(0, (n - 1) * ps + 1) if n else 0, n * ps))
    whole = valid // ps
    upto = cdiv(valid, ps) if final else whole
    sent = data.draw(st.integers(0, upto))
    m = manifest_for("r", RequestPages(owners, slots, valid), ps, c, final=final, already_sent=sent)
    assert m.num_pages == upto and m.first_page == sent
    assert m.valid_len == (valid if final else whole * ps)  # a non-final chunk: whole pages only
    seen = []
    for part in m.parts:
        assert part.runs, "parts without pages are left out"
        for run in part.runs:
            for i in range(run.num_pages):
                k = run.first_page + i
                assert owners[k] == part.rank and slots[k] == run.src_slot + i
                seen.append(k)
        # coalesced: two neighbouring runs of a part are never contiguous in both page and slot
        for a, b in itertools.pairwise(part.runs):
            assert not (b.first_page == a.first_page + a.num_pages
                        and b.src_slot == a.src_slot + a.num_pages)
    assert sorted(seen) == list(range(sent, upto))


def test_coalesce_merges_contiguous_runs() -> None:
    runs = coalesce([(0, 4), (1, 5), (2, 6), (4, 7), (5, 9), (6, 10)])
    assert [(r.first_page, r.num_pages, r.src_slot) for r in runs] == [(0, 3, 4), (4, 1, 7),
                                                                       (5, 2, 9)]
    with pytest.raises(ValueError, match="exactly once"):
        TransferManifest(request="x", page_size=4, valid_len=8, num_pages=2, parts=(
            RankTransfer(request="x", rank=0, runs=tuple(coalesce([(0, 0)]))),))


# ---- receiver ----------------------------------------------------------------------------------

@pytest.mark.parametrize("c", [1, 2, 4])
def test_receiver_places_pages_at_logical_positions(c: int) -> None:
    ranks, owners, slots = fake_source(c, 9, seed=c)
    rx = receiver_of(torch_pool(CPGroup.single()), debug=True)
    assert transfer_pages(rx, ranks, owners, slots, "a", 9 * PAGE - 3)
    assert rx.pages.requests["a"].valid_len == 9 * PAGE - 3 and rx.in_flight() == []
    check_landed(rx, ranks, "a", owners, slots)


def test_receiver_rejects_a_cp_pool() -> None:
    pool = torch_pool(CPGroup.single())
    pool.store.group = CPGroup(rank=0, size=2, backend="gloo", device=torch.device("cpu"), timeout_s=1)
    with pytest.raises(ValueError, match="one-rank group"):
        receiver_of(pool)


def test_chunks_extend_the_published_entry() -> None:
    """Rule 26: whole pages after a non-final chunk, the tail page after the final one."""
    ranks, owners, slots = fake_source(2, 7)
    rx = receiver_of(torch_pool(CPGroup.single()), debug=True)
    m1 = manifest_for("a", RequestPages(owners[:3], slots[:3], 21), PAGE, 2, final=False)  # 2 whole of 21
    assert (m1.num_pages, m1.valid_len) == (2, 16)
    rx.reserve(m1)
    assert rx.complete(m1, deliver(rx, ranks, m1))
    assert rx.pages.requests["a"].valid_len == 16 and len(rx.pages.requests["a"].slots) == 2
    m2 = manifest_for("a", RequestPages(owners, slots, 53), PAGE, 2, final=True, already_sent=2)
    assert (m2.first_page, m2.num_pages, m2.valid_len) == (2, 7, 53)
    rx.reserve(m2)
    assert rx.complete(m2, deliver(rx, ranks, m2))
    assert rx.pages.requests["a"].valid_len == 53
    check_landed(rx, ranks, "a", owners, slots)
    bad = manifest_for("b", RequestPages(owners, slots, 53), PAGE, 2, already_sent=2)  # no earlier chunk
    with pytest.raises(TransferError, match="starts at page 2"):
        rx.reserve(bad)


@pytest.mark.parametrize("fault", ["missing_part", "wrong_count", "checksum", "extra_rank"])
def test_faulty_transfer_publishes_nothing(fault: str) -> None:
    ranks, owners, slots = fake_source(2, 8, seed=5)
    rx = receiver_of(torch_pool(CPGroup.single()), debug=True)
    assert transfer_pages(rx, ranks, owners, slots, "before", 12)  # something already published
    before = pool_snapshot(rx.pages)
    m = manifest_for("a", RequestPages(owners, slots, 61), PAGE, 2)
    rx.reserve(m)
    sums: dict[int, list[int]]
    if fault == "missing_part":
        sums = deliver(rx, ranks, m, skip=1)
        why = "rank 1's part"
    elif fault == "wrong_count":
        part = m.parts[0]
        buf = pack_part(ranks[0].pool.store, part)
        with pytest.raises(TransferError, match="expected"):
            rx.place_packed(part, buf[: -part_nbytes(rx.store, 1)])  # one page short
        short = RankTransfer(request="a", rank=0, runs=part.runs[:-1])
        with pytest.raises(TransferError, match="does not match the manifest"):
            rx.place_packed(short, pack_part(ranks[0].pool.store, short))
        sums = deliver(rx, ranks, m, skip=0)
        why = "rank 0's part"
    elif fault == "checksum":
        sums = deliver(rx, ranks, m)
        rx.store.latent[1][rx.dst_slots(m.parts[1])[0], 3, 5] ^= 1  # one bit flipped in flight
        why = "checksum mismatch in rank 1's pages"
    else:
        sums = deliver(rx, ranks, m)
        with pytest.raises(TransferError, match="does not match"):
            rx.mark_written(RankTransfer(request="a", rank=3, runs=m.parts[0].runs))
        sums = {**sums, 1: sums[1][:-1]}
        why = "checksum"
    assert not rx.complete(m, sums)
    assert why in (rx.last_error or "") and "nothing published" in (rx.last_error or "")
    assert pool_snapshot(rx.pages) == before and rx.in_flight() == []
    next_request_works(rx)


def test_counts_are_checked_without_debug() -> None:
    ranks, owners, slots = fake_source(2, 4, seed=2)
    rx = receiver_of(torch_pool(CPGroup.single()), debug=False)
    before = pool_snapshot(rx.pages)
    m = manifest_for("a", RequestPages(owners, slots, 30), PAGE, 2)
    rx.reserve(m)
    deliver(rx, ranks, m, skip=0)
    assert not rx.complete(m) and pool_snapshot(rx.pages) == before
    next_request_works(rx)


def test_reserve_is_all_or_nothing() -> None:
    ranks, owners, slots = fake_source(2, 6, seed=3)
    rx = receiver_of(torch_pool(CPGroup.single(), capacity=8))
    assert transfer_pages(rx, ranks, owners, slots, "a", 6 * PAGE)
    before = pool_snapshot(rx.pages)
    m = manifest_for("b", RequestPages(owners, slots, 6 * PAGE), PAGE, 2)
    with pytest.raises(PoolExhausted):
        rx.reserve(m)
    assert pool_snapshot(rx.pages) == before and rx.in_flight() == []
    rx.free("a")
    next_request_works(rx)


# ---- the protocol over a fake link: a transport error mid-way ---------------------------------

class _Box:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, k: str, v: bytes) -> None:
        self.data[k] = v

    def get(self, k: str) -> bytes:
        return self.data[k]

    def wait(self, keys: list[str], timeout: Any) -> None:
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise TimeoutError(f"no message {missing}")

    def delete_key(self, k: str) -> None:
        self.data.pop(k, None)


class _FailingLink:
    """Decode side of a two-sided link whose data plane dies after ``ok_parts`` parts."""

    one_sided = False
    writes_receiver_layout = False

    def __init__(self, channel: StoreSideChannel, ranks: list[FakeRank], ok_parts: int) -> None:
        self.channel, self.ranks, self.left = channel, ranks, ok_parts

    def send_part(self, part: RankTransfer, dst: Any, **kw: Any) -> int:
        raise NotImplementedError

    def recv_part(self, part: RankTransfer, rx: DecodeReceiver, *, layers: Any = None,
                  epoch: int = 0) -> int:
        if self.left == 0:
            raise ConnectionError("peer went away")
        self.left -= 1
        rx.place_packed(part, pack_part(self.ranks[part.rank].pool.store, part, layers), layers=layers)
        return part_nbytes(rx.store, part.num_pages)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("ok_parts", [0, 1])
def test_transport_error_midway_publishes_nothing(ok_parts: int) -> None:
    ranks, owners, slots = fake_source(2, 8, seed=7)
    rx = receiver_of(torch_pool(CPGroup.single()), debug=True)
    before = pool_snapshot(rx.pages)
    store = _Box()
    senders = [StoreSideChannel(store, r, 1.0) for r in range(2)]
    m = manifest_for("a", RequestPages(owners, slots, 60), PAGE, 2)
    for r, ch in enumerate(senders):
        part = next(p for p in m.parts if p.rank == r)
        ch.send(2, Offer(r, m, part_nbytes(rx.store, part.num_pages), None))
    link = _FailingLink(StoreSideChannel(store, 2, 1.0), ranks, ok_parts)
    with pytest.raises(TransferError, match=r"receiving rank \d.s part: ConnectionError: peer went "
                                            r"away.*nothing published"):
        DecodeTransfer(link, rx, 2).receive()
    for ch in senders:
        assert isinstance(ch.recv(2), Grant)
        ack = ch.recv(2)
        assert isinstance(ack, Ack) and not ack.published and "peer went away" in ack.error
    assert pool_snapshot(rx.pages) == before and rx.in_flight() == []
    next_request_works(rx)


def test_mismatched_offers_are_refused() -> None:
    ranks, owners, slots = fake_source(2, 8, seed=8)
    rx = receiver_of(torch_pool(CPGroup.single()))
    before = pool_snapshot(rx.pages)
    store = _Box()
    m = manifest_for("a", RequestPages(owners, slots, 60), PAGE, 2)
    StoreSideChannel(store, 0, 1.0).send(2, Offer(0, m, part_nbytes(rx.store, m.parts[0].num_pages)))
    StoreSideChannel(store, 1, 1.0).send(2, Offer(1, m, 12345))  # wrong byte count
    link = _FailingLink(StoreSideChannel(store, 2, 1.0), ranks, 2)
    with pytest.raises(TransferRefused, match="rank 1 offers 12345 bytes"):
        DecodeTransfer(link, rx, 2).receive()
    assert pool_snapshot(rx.pages) == before
    for r in range(2):  # every rank hears the refusal (a grant without slots)
        grant = StoreSideChannel(store, r, 1.0).recv(2)
        assert isinstance(grant, Grant) and grant.dst_slots is None and "12345" in grant.error


def test_link_capabilities_are_resolved_once_from_declared_protocols() -> None:
    store = _Box()
    two_sided = _FailingLink(StoreSideChannel(store, 2, 1.0), [], 0)
    f = link_features(two_sided)  # a store channel fences; this link cannot drain
    assert (f.one_sided, f.writes_receiver_layout, f.draining) == (False, False, None)
    assert f.fencing is two_sided.channel

    class Draining(_FailingLink):
        def abandon(self, rest: Any, epoch: int) -> None:
            pass

    assert link_features(Draining(StoreSideChannel(store, 2, 1.0), [], 0)).draining is not None

    class NoLayout:  # an old link that does not declare writes_receiver_layout
        one_sided = True
        channel = StoreSideChannel(store, 2, 1.0)

        def send_part(self, *a: Any, **k: Any) -> int:
            return 0

        def recv_part(self, *a: Any, **k: Any) -> int:
            return 0

        def close(self) -> None:
            pass

    with pytest.raises(TypeError, match=r"NoLayout is not a cpkv\.disagg\.Link.*writes_receiver_layout"):
        DecodeTransfer(NoLayout(), receiver_of(torch_pool(CPGroup.single())), 2)  # type: ignore[arg-type]


def test_plugins_see_the_registered_buffers_not_the_pool() -> None:
    """The buffers view shares the pool's memory, and packs a part as the receiver unpacks it."""
    src = FakeRank(seed=3)
    bufs = registered_buffers(src.pool.store)
    assert (bufs.num_layers, bufs.num_pages, bufs.page_bytes) == (
        src.pool.num_layers, src.pool.store.capacity, src.pool.fmt.page_bytes)
    assert all(b.data_ptr() == k.data_ptr() for b, k in zip(bufs.kv, src.pool.store.kv, strict=True))
    bufs.kv[1][5].fill_(7)  # a write through the view lands in the pool
    assert bool((src.pool.store.latent[1][5] == 7).all()) and bool((src.pool.store.index_k[1][5] == 7).all())
    m = manifest_for("a", RequestPages([0] * 3, [5, 1, 2], 3 * PAGE), PAGE, 1)
    packed = bufs.pack(m.parts[0], range(1, 2))
    assert packed.numel() == bufs.nbytes(3, range(1, 2)) == part_nbytes(src.pool.store, 3,
                                                                        range(1, 2))
    rx = receiver_of(torch_pool(CPGroup.single()))
    rx.reserve(m)
    rx.place_packed(m.parts[0], bufs.pack(m.parts[0]))
    assert rx.complete(m)
    check_landed(rx, [src], "a", [0] * 3, [5, 1, 2])


# ---- NCCL plugin over Gloo, C prefill ranks -> one decode rank ---------------------------------

def test_nccl_plugin_loads_a_transport() -> None:
    from cpkv.disagg import Transport
    from cpkv.plugin import PluginHost

    h = PluginHost(allow=["nccl"])
    try:
        reg = h.transfers()
        assert reg.availability("nccl").available
        t = reg.select(["nccl"])["transfer"].impl
        assert isinstance(t, Transport) and t.name == "nccl"
    finally:
        h.close()


#: non-contiguous page runs of the packed-send test: more than an NCCL group's op cap
MANY_RUNS = 300


def _packed_sends_rank(world: CPGroup, pipeline: str) -> dict[str, Any]:
    """Endpoint 0 sends a part of MANY_RUNS one-page runs (every other slot) to endpoint 1 over
    the nccl link (Gloo), per layer or per request; then MANY_RUNS late messages of a given-up
    grant that the decode drains. Returns the link's op counts and (decode) whether the pages
    landed byte for byte."""
    from cpkv.disagg import LinkSpec
    from cpkv_transfer_nccl.transport import NcclTransport

    # both endpoints make the sender's pool (seeded): the decode checks the bytes against it
    src = FakeRank(seed=11, like=torch_pool(CPGroup.single()).store, capacity=2 * MANY_RUNS)
    slots = [2 * k + 1 for k in range(MANY_RUNS)]
    m = manifest_for("many", RequestPages([0] * MANY_RUNS, slots, MANY_RUNS * PAGE), PAGE, 1)
    part, late = m.parts[0], manifest_for("late", RequestPages([0], [0], PAGE), PAGE, 1).parts[0]
    groups = ([range(k, k + 1) for k in range(src.pool.num_layers)] if pipeline == "layer"
              else [range(src.pool.num_layers)])
    pool = src.pool if world.rank == 0 else torch_pool(CPGroup.single(), capacity=MANY_RUNS + 4)
    link = NcclTransport().connect(LinkSpec(endpoint=world.rank, cp_size=1,
                                            buffers=registered_buffers(pool.store), timeout_s=60))
    out: dict[str, Any] = {}
    if world.rank == 0:
        for g in groups:
            link.send_part(part, list(range(MANY_RUNS)), layers=g, epoch=1)
        for _ in range(MANY_RUNS):  # a given-up grant's messages, sent late
            link.send_part(late, [0], layers=range(0, 1), epoch=2)
    else:
        rx = receiver_of(pool)
        rx.reserve(m)
        for g in groups:
            link.recv_part(part, rx, layers=g, epoch=1)
        assert rx.complete(m), rx.last_error
        check_landed(rx, [src], "many", [0] * MANY_RUNS, slots)
        out["landed"] = True
        link.abandon([(range(0, 1), late)] * MANY_RUNS, epoch=2)
        for work, _ in link.abandoned:  # every late message was drained
            work.wait()
        out["groups"] = list(link.stats.groups)
    kind = "send" if world.rank == 0 else "recv"
    out["per_layer_peer"] = dict(link.stats.per_layer_and_peer(kind, 1))
    out["totals"] = dict(link.stats.totals)
    world.barrier()
    link.close()
    return out


@pytest.mark.multiprocess
# the request pipeline (6.6 CPU seconds) is slow: its transfer and decode stay fast above
@pytest.mark.parametrize("pipeline", ["layer", pytest.param("request", marks=pytest.mark.slow)])
def test_nccl_sends_one_packed_buffer_per_layer_and_peer(pipeline: str) -> None:
    """A part of MANY_RUNS non-contiguous page runs (more than an NCCL group may hold) moves as
    one send and one receive per layer (per request: one for all layers), and lands byte for
    byte; the drain receives of a given-up grant are posted in groups of at most
    MAX_OPS_PER_GROUP."""
    from cpkv_transfer_nccl.transport import MAX_OPS_PER_GROUP, op_groups

    assert MANY_RUNS > MAX_OPS_PER_GROUP
    snd, dec = (r.value for r in run_ranks(_packed_sends_rank, 2, args=(pipeline,),
                                           timeout_s=120))
    layers = torch_pool(CPGroup.single()).num_layers
    assert snd["per_layer_peer"] == {(layer, 1): 1 for layer in range(layers)}
    assert dec["per_layer_peer"] == {(layer, 0): 1 for layer in range(layers)}
    n_data = layers if pipeline == "layer" else 1
    assert snd["totals"] == {"send": n_data + MANY_RUNS}
    assert dec["totals"] == {"recv": n_data, "drain": MANY_RUNS}
    assert dec["landed"]
    assert dec["groups"] == [len(g) for g in op_groups(MANY_RUNS)] == [256, MANY_RUNS - 256]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "prefix", "pipeline", "layout"), [
    pytest.param(2, "zigzag", (20, 0, 3, 64), "request", "token_major",
                 marks=pytest.mark.slow),  # 10 CPU seconds
    # the engines' two-part prefill pools: the packed part layout read from their tensors
    (2, "zigzag", (20, 0, 3, 64), "layer", "two_part"),
    pytest.param(2, "zigzag", (20, 0, 3, 64), "layer", "token_major", marks=pytest.mark.slow),
    pytest.param(4, "interleave", (), "layer", "token_major", marks=pytest.mark.slow)])
def test_nccl_transfer_and_decode(tiny: Path, cp: int, mode: str, prefix: tuple[int, ...],
                                  pipeline: str, layout: str) -> None:
    spec = job_spec(tiny, cp, mode, prefix, pipeline=pipeline)
    spec = replace(spec, settings=spec.settings.model_copy(
        update={"kv": spec.settings.kv.model_copy(update={"layout": layout})}))
    out = run_ranks(disagg_rank, cp + 1, args=(spec,), timeout_s=300)
    senders: list[SenderReport] = [r.value for r in out[:cp]]
    dec: DecodeReport = out[cp].value
    model = load_model(str(tiny))
    page_bytes = model.kv_format("fp32", PAGE).page_bytes * model.num_layers
    for r, snd in enumerate(senders):
        owned = sum(len(v) for v in snd.page_crcs.values())
        assert snd.bytes_sent == owned * page_bytes, f"rank {r} sent other than its own pages"
        assert dec.bytes_per_rank[r] == snd.bytes_sent
    # every logical page landed where it belongs: decode page k == its owner's page k
    for rid, crcs in dec.page_crcs.items():
        owner_crc = {}
        for snd in senders:
            owner_crc.update(snd.page_crcs[rid])
        assert crcs == [owner_crc[k] for k in range(len(crcs))], rid
    # chunked prefill: whole pages after the non-final chunk, the tail after the final one
    by_req: dict[str, list[TransferManifest]] = {}
    for m in senders[0].manifests:
        by_req.setdefault(m.request, []).append(m)
    for rid, ms in by_req.items():
        for m in ms[:-1]:
            assert m.valid_len % PAGE == 0 and m.num_pages * PAGE == m.valid_len
        for a, b in itertools.pairwise(ms):
            assert b.first_page == a.num_pages
        assert ms[-1].valid_len == len(spec.prompts[int(rid[1:])])
    if prefix:
        assert any(len(ms) == 2 for ms in by_req.values())
    assert all(snd.pipeline == pipeline and len(snd.ready_seconds) == len(senders[0].manifests)
               for snd in senders)
    if pipeline == "layer":  # the sends started while the prefill still computed
        assert all(snd.overlap_seconds > 0 for snd in senders if snd.bytes_sent)
    else:
        assert all(snd.overlap_seconds == 0 for snd in senders)
    assert dec.tokens == reference_tokens(spec)


def _decode_then_record(world: CPGroup, spec: JobSpec, out: str) -> Any:
    """The decode rank of the kill test: receive, and on failure record the pool's state and
    whether the next (local) request still works, then re-raise."""
    from datetime import timedelta

    import torch.distributed as dist

    from cpkv.disagg import select_transport
    from cpkv.runtime.decode import DecodeSession

    s, c = spec.settings, spec.settings.cp.size
    if world.rank == 1:
        from cpkv_transfer_nccl.transport import NcclLink

        def die(self: Any, part: Any, dst: Any, **kw: Any) -> int:
            os._exit(3)

        NcclLink.send_part = die  # type: ignore[method-assign]
    if world.rank < c:
        return disagg_rank(world, spec)
    dist.new_group(list(range(c)), timeout=timedelta(seconds=s.runtime.timeout_s))
    decode = DecodeSession(load_model(spec.model_dir), s)  # debug: checksums compared
    decode.connect(select_transport(s, world.agree_all), cp_size=c)
    worker = decode.worker
    fresh = worker.pool.pages.allocator.snapshot()
    try:
        decode.receive()
    except TransferError as exc:
        rec: dict[str, Any] = {"error": str(exc), "table": list(worker.pool.pages.requests),
                               "unchanged": worker.pool.pages.allocator.snapshot() == fresh,
                               "in_flight": worker.receiver.in_flight()}
        next_request_works(worker.receiver)  # raises if the pool is not usable
        rec["next_ok"] = True
        Path(out).write_text(json.dumps(rec))
        raise
    return None


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rank_killed_mid_transfer(tiny: Path, tmp_path: Path) -> None:
    spec = job_spec(tiny, 2, "zigzag")
    out = tmp_path / "decode.json"
    with pytest.raises(RankFailed) as info:
        run_ranks(_decode_then_record, 3, args=(spec, str(out)), timeout_s=120, settle_s=5.0)
    assert info.value.rank == 1 and info.value.exitcode == 3
    rec = json.loads(out.read_text())
    assert "'p0' failed receiving rank 1's part" in rec["error"]
    assert "nothing published" in rec["error"]
    assert rec["table"] == [] and rec["unchanged"] and rec["in_flight"] == [] and rec["next_ok"]


def test_latent_only_layers_move_no_index_bytes() -> None:
    """A pool whose layer 1 caches no index-K (a GLM-5 shared-indexer layer): a part packs and
    lands with that layer's latent only, the bytes moved are what its formats say, and the
    receiver's pages equal the sender's."""
    from cpkv.kv import ShardedKVPool

    full = small_format()
    fmts = [full, full.latent_only()]
    src = ShardedKVPool(fmts, 2, CPGroup.single(), torch_pool(CPGroup.single()).store.ops,
                        pages_per_rank=16)
    for b in src.store.kv:
        b.random_(0, 255, generator=torch.Generator().manual_seed(4))
    bufs = registered_buffers(src.store)
    m = manifest_for("a", RequestPages([0] * 3, [5, 1, 2], 3 * PAGE), PAGE, 1)
    packed = bufs.pack(m.parts[0])
    want = 3 * (full.page_bytes + full.latent_page_bytes)
    assert packed.numel() == bufs.nbytes(3) == part_nbytes(src.store, 3) == want
    assert want < 3 * 2 * full.page_bytes
    dst = ShardedKVPool(fmts, 2, CPGroup.single(), src.store.ops, pages_per_rank=16)
    rx = receiver_of(dst)
    rx.reserve(m)
    rx.place_packed(m.parts[0], packed)
    for layer in range(2):
        for s_src, s_dst in zip([5, 1, 2], rx.dst_slots(m.parts[0]), strict=True):
            assert torch.equal(dst.store.kv[layer][s_dst], src.store.kv[layer][s_src])
