"""The Mooncake transfer plugin (real engines, TCP over 127.0.0.1): C = 2 and 4 prefill ranks ->
one decode rank, and faults (peer killed mid-transfer, wrong address, timeout, a batch over the
engine's limit): a clear error, nothing published, the decode pool unchanged and usable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import helpers
from cpkv.comm import CPGroup
from cpkv.contracts import KVFormat
from cpkv.disagg import (
    DecodeReceiver,
    DecodeTransfer,
    LinkSpec,
    PrefillTransfer,
    RankTransfer,
    TransferError,
    TransferFenced,
    manifest_for,
    registered_buffers,
)
from cpkv.disagg.plan import PageRun
from cpkv.fallback import recording
from cpkv.kv import RequestPages
from cpkv.runtime import RankFailed, run_ranks
from cpkv.runtime.job import DecodeReport, JobSpec, SenderReport, disagg_rank
from cpkv.settings import PluginTable, SettingsError, TransferSettings, load_settings
from cpkv_transfer_mooncake.plugin import probe

_AVAIL = probe()
pytestmark = [pytest.mark.mooncake,
              pytest.mark.skipif(not _AVAIL.available, reason=f"mooncake: {_AVAIL.reason}")]


# ---- no engine: entries, batches, limits -------------------------------------------------------

def _buffers(n_pages: int) -> Any:
    """The registered buffers of a one-rank CPU pool of ``n_pages`` pages."""
    return registered_buffers(helpers.torch_pool(CPGroup.single(), capacity=n_pages).store)


def _layout(n: int, base: int, layers: int = 2, page_bytes: tuple[int, ...] = ()) -> Any:
    """A layout of one region per layer (``page_bytes[l]``, default 110 bytes) at ``base``."""
    from cpkv_transfer_mooncake.transport import Layout, Region

    sizes = page_bytes or (110,) * layers
    return Layout(layers=tuple((Region(base + 10**6 * i, b),) for i, b in enumerate(sizes)),
                  num_pages=n)


def test_entries_split_at_destination_gaps_and_merge_continuations() -> None:
    from cpkv_transfer_mooncake.transport import write_entries

    part = RankTransfer(request="a", rank=0, runs=(PageRun(first_page=0, num_pages=3, src_slot=5),
                                                   PageRun(first_page=4, num_pages=2, src_slot=8)))
    src, dst = _layout(16, 0), _layout(16, 10**8)
    # run 1 lands at 0,1 then 7 (a gap: split); run 2 continues the 7 in both slots (merged)
    ent = write_entries(part, [0, 1, 7, 8, 9], src, dst)
    pieces = [(5, 0, 2), (7, 7, 3)]
    want = []
    for s, d, n in pieces:
        for layer in range(2):
            want.append((src.kv[layer] + s * 110, dst.kv[layer] + d * 110, n * 110))
    assert ent == want
    assert sum(e[2] for e in ent) == 5 * 2 * 110  # exactly the part's bytes
    with pytest.raises(ValueError, match="destination slots"):
        write_entries(part, [0, 1], src, dst)
    with pytest.raises(ValueError, match="out of range"):
        write_entries(part, [0, 1, 7, 8, 16], src, dst)
    with pytest.raises(ValueError, match="different page layouts"):
        write_entries(part, [0, 1, 7, 8, 9], src, _layout(16, 10**8, layers=3))


class _FakeEngine:
    """Stands in for ``_Engine``: records batches; fails the first ``fail`` writes."""

    def __init__(self, fail: int = 0) -> None:
        self.batches: list[int] = []
        self.fail = fail

    def write(self, peer: str, entries: Any) -> int:
        if self.fail:
            self.fail -= 1
            return -1
        self.batches.append(len(entries))
        return 0

    def close(self) -> None:
        pass


class _Channel:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, peer: int, msg: Any) -> None:
        self.sent.append(msg)

    def recv(self, peer: int) -> Any:
        from cpkv.disagg import Ack

        return Ack("a", False, "rank 0's writes failed; nothing published")


def _bare_link(n_pages: int, max_batch: int, retries: int = 0, fail: int = 0) -> Any:
    from cpkv_transfer_mooncake.transport import MooncakeLink

    link = object.__new__(MooncakeLink)
    pool = helpers.torch_pool(CPGroup.single(), capacity=n_pages)
    link.spec = LinkSpec(endpoint=0, cp_size=1, buffers=registered_buffers(pool.store))
    link.max_batch, link.retries = max_batch, retries
    link.stage = link.relayout = None
    link.local = link.remote_layout = _layout(n_pages, 0)
    link.remote = "127.0.0.1:1"
    link.engine = _FakeEngine(fail)
    link.stats = {"batches": 0, "entries": 0, "largest_batch": 0, "retries": 0}
    link.channel = _Channel()
    link._renew_engine = lambda: setattr(link, "engine", _FakeEngine())
    return link


def test_batches_stay_within_the_limit_and_retries_use_a_fresh_engine() -> None:
    # 700 pages, every other destination slot: 700 pieces x 2 layers = 1400 entries (a page's
    # latent and index-K are one block)
    part = RankTransfer(request="a", rank=0, runs=(PageRun(first_page=0, num_pages=700, src_slot=0),))
    link = _bare_link(1400, 1024)
    assert link.send_part(part, list(range(0, 1400, 2))) == part_bytes(link, 700)
    assert link.engine.batches == [1024, 376]
    link = _bare_link(1400, 1024)  # one layer: 700 entries, its share of the bytes
    assert link.send_part(part, list(range(0, 1400, 2)), layers=range(1, 2)) == \
        part_bytes(link, 700) // 2
    assert link.engine.batches == [700]
    link = _bare_link(1400, 1024, retries=1, fail=1)
    with recording() as rec:
        link.send_part(part, list(range(0, 1400, 2)))
    assert link.stats["retries"] == 1 and link.stats["batches"] == 2
    assert [e.reason.value for e in rec.events] == ["transfer_retry"]  # a retry is reported
    link = _bare_link(1400, 1024, retries=1, fail=5)
    link._renew_engine = lambda: setattr(link, "engine", _FakeEngine(fail=5))
    with pytest.raises(TransferError, match=r"failed writing its part of 'a' .*returned -1 after "
                                            r"2 attempt\(s\)"):
        link.send_part(part, list(range(0, 1400, 2)))


def test_a_fenced_grant_gets_no_more_batches() -> None:
    """The fence is checked before each batch: once the decode gave the grant up, nothing more
    is written (and the engine is kept: nothing failed)."""
    part = RankTransfer(request="a", rank=0, runs=(PageRun(first_page=0, num_pages=700, src_slot=0),))
    link = _bare_link(1400, 512)
    engine = link.engine
    checks = iter([False, True])
    with pytest.raises(TransferFenced, match=r"fenced: the decode gave grant 7 up; 512 of 1400"):
        link.send_part(part, list(range(0, 1400, 2)), epoch=7, fenced=lambda: next(checks))
    assert engine.batches == [512] and link.engine is engine


def part_bytes(link: Any, n: int) -> int:
    return int(link.spec.buffers.nbytes(n))


def _mooncake_settings(**keys: Any) -> Any:
    """``[transfer.mooncake]`` given as keyword arguments, parsed as a link parses it at connect."""
    from cpkv_transfer_mooncake.settings import MooncakeSettings

    s = load_settings(transfer={"name": "mooncake", "mooncake": keys})
    return s.transfer_table().parse(MooncakeSettings)


def test_a_misconfigured_batch_limit_is_rejected_at_startup() -> None:
    from cpkv_transfer_mooncake.transport import MooncakeLink

    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.max_batch_entries: value error, "
                                            r"max_batch_entries = 4096 is outside 1\.\.1024.*"
                                            r"\[from keyword arguments\]"):
        _mooncake_settings(max_batch_entries=4096)
    assert _mooncake_settings().max_batch_entries == 1024
    # a link validates its table first, before any collective or engine
    table = load_settings(transfer={"mooncake": {"max_batch_entries": 0}}).transfer.table("mooncake")
    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.max_batch_entries"):
        MooncakeLink(LinkSpec(endpoint=0, cp_size=1, buffers=_buffers(1), options=table), None)
    # the old flat key is gone: an error naming it
    with pytest.raises(SettingsError, match=r"transfer\.max_batch_entries: value error, not a "
                                            r"\[transfer\] setting.*\[transfer\.mooncake\]"):
        load_settings(transfer={"name": "mooncake", "max_batch_entries": 512})


def test_a_misspelt_mooncake_key_is_an_error_naming_it_and_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cpkv_transfer_mooncake.settings import MooncakeSettings

    cfg = tmp_path / "cpkv.toml"
    cfg.write_text('[transfer]\nname = "mooncake"\n[transfer.mooncake]\nretries = 2\n'
                   'protocl = "rdma"\n')
    with pytest.raises(SettingsError, match=rf"transfer\.mooncake\.protocl: unknown key; did you "
                                            rf"mean transfer\.mooncake\.protocol\? "
                                            rf"\[from {re.escape(str(cfg))}\]"):
        load_settings(cfg).transfer_table().parse(MooncakeSettings)
    cfg.write_text('[transfer]\nname = "mooncake"\n[transfer.mooncake]\nretries = 2\n')
    monkeypatch.setenv("CPKV_TRANSFER__MOONCAKE__STAGE", "device")
    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.stage: .*'device'.*\[from "
                                            r"environment variable CPKV_TRANSFER__MOONCAKE__STAGE\]"):
        load_settings(cfg).transfer_table().parse(MooncakeSettings)
    monkeypatch.setenv("CPKV_TRANSFER__MOONCAKE__STAGE", "host")
    got = load_settings(cfg).transfer_table().parse(MooncakeSettings)
    assert (got.retries, got.stage, got.protocol) == (2, "host", "tcp")


# ---- host staging (transfer.stage) ------------------------------------------------------------

def test_stage_pieces_fit_the_buffer_and_cover_the_send() -> None:
    from cpkv_transfer_mooncake.transport import stage_pieces

    # every layer fits: all in one piece; two of three layers fit: pieces of two layers
    ten = (10,) * 4
    assert stage_pieces(4, range(3), ten, 120) == [(range(3), 0, 4)]
    assert stage_pieces(4, range(1, 4), ten, 80) == [(range(1, 3), 0, 4), (range(3, 4), 0, 4)]
    # one layer does not fit: each layer in page ranges of 3 (the buffer's whole pages)
    assert stage_pieces(7, range(2), ten, 35) == [(range(0, 1), 0, 3), (range(0, 1), 3, 6),
                                                   (range(0, 1), 6, 7), (range(1, 2), 0, 3),
                                                   (range(1, 2), 3, 6), (range(1, 2), 6, 7)]
    assert stage_pieces(0, range(2), ten, 35) == []
    with pytest.raises(ValueError, match="holds no page"):
        stage_pieces(1, range(1), ten, 9)
    # layers of their own page bytes (GLM-5: latent-only shared layers): whole layers while
    # their sum fits; a layer too large alone in page ranges of its own page size
    mixed = (10, 6, 6, 10)
    assert stage_pieces(4, range(4), mixed, 88) == [(range(0, 3), 0, 4), (range(3, 4), 0, 4)]
    assert stage_pieces(4, range(4), mixed, 64) == [(range(0, 2), 0, 4), (range(2, 4), 0, 4)]
    assert stage_pieces(4, range(4), mixed, 30) == [(range(0, 1), 0, 3), (range(0, 1), 3, 4),
                                                    (range(1, 2), 0, 4), (range(2, 3), 0, 4),
                                                    (range(3, 4), 0, 3), (range(3, 4), 3, 4)]


def test_staged_entries_merge_where_destinations_continue() -> None:
    from cpkv_transfer_mooncake.transport import staged_entries

    dst = _layout(16, 10**8, layers=3)
    # pages 1..4 of the part (destinations 7, 8, 3, 4) of layers 1 and 2, staged at 1000:
    # destinations jump once, so two runs per layer; layer j of the piece at 1000 + j x 4 pages
    ent = staged_entries([0, 7, 8, 3, 4, 9], 1, 5, 1000, dst, range(1, 3))
    assert ent == [(1000, dst.kv[1] + 7 * 110, 220), (1000 + 220, dst.kv[1] + 3 * 110, 220),
                   (1000 + 440, dst.kv[2] + 7 * 110, 220), (1000 + 660, dst.kv[2] + 3 * 110, 220)]
    # layers of other page bytes: each layer's staged pages at its own stride, one after another
    mixed = _layout(16, 10**8, page_bytes=(110, 70, 110))
    ent = staged_entries([0, 7, 8, 3, 4, 9], 1, 5, 1000, mixed, range(1, 3))
    assert ent == [(1000, mixed.kv[1] + 7 * 70, 140), (1000 + 140, mixed.kv[1] + 3 * 70, 140),
                   (1000 + 280, mixed.kv[2] + 7 * 110, 220),
                   (1000 + 500, mixed.kv[2] + 3 * 110, 220)]


def test_stage_decision() -> None:
    from cpkv_transfer_mooncake.transport import stage_reason

    assert "cudaMemcpy" in (stage_reason("auto", "cuda", "tcp") or "")
    assert stage_reason("auto", "cpu", "tcp") is None  # the pool is host memory already
    assert stage_reason("auto", "cuda", "nvlink") is None  # device to device
    assert stage_reason("auto", "cuda", "rdma") is None  # GPUDirect: the NIC reads the pool
    assert stage_reason("host", "cpu", "tcp") == "transfer.mooncake.stage = 'host'"
    assert stage_reason("none", "cuda", "tcp") is None


def test_stage_options_are_validated() -> None:
    got = _mooncake_settings()
    assert (got.stage, got.stage_mb) == ("auto", 64)
    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.stage: input should be 'auto', "
                                            r"'host' or 'none'"):
        _mooncake_settings(stage="device")
    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.stage_mb: input should be greater"):
        _mooncake_settings(stage_mb=0)
    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.stage_mb: input should be less"):
        _mooncake_settings(stage_mb=5000)
    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.stage: .*'gpu'.*\n.*"
                                            r"transfer\.mooncake\.stage_mb: .*-1"):  # one line each
        _mooncake_settings(stage_mb=-1, stage="gpu")


class _CopyEngine:
    """Stands in for ``_Engine`` in one process: each entry is a ``memmove`` (a real write of the
    entry's bytes from its source address, e.g. the staging buffer, into the destination pool)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int, int]]] = []

    def write(self, peer: str, entries: Any) -> int:
        import ctypes

        for src, dst, n in entries:
            ctypes.memmove(dst, src, n)
        self.batches.append(list(entries))
        return 0

    def close(self) -> None:
        pass


def _staged_link(stage_bytes: int | None, max_batch: int = 1024, mixed: bool = False,
                 layouts: tuple[str, str] = ("token_major", "token_major"),
                 fmt: Any = None) -> tuple[Any, Any, Any]:
    """A bare prefill link on a CPU pool of random bytes that stages through a ``stage_bytes``
    host buffer (None: no staging, the entries read the pool) and "writes" (memmove) into a
    second pool; returns (link, source, decode pool). ``mixed``: layer 1 latent-only (a GLM-5
    shared-indexer layer: its pages smaller than the others'). ``layouts``: the sender's and
    the decode pool's (different ones: the sender re-lays the pages out while staging);
    ``fmt``: the full layers' format (default the bf16 ``helpers.small_format``)."""
    import torch

    from cpkv.contracts import BufferLayout
    from cpkv.kv import ShardedKVPool
    from cpkv_transfer_mooncake.transport import HostStaging, Layout, MooncakeLink

    ops = helpers.torch_pool(CPGroup.single(), capacity=1).store.ops
    full = helpers.small_format() if fmt is None else fmt
    fmts = [full, full.latent_only(), full] if mixed else [full] * 3
    src, dec = (ShardedKVPool(fmts, 3, CPGroup.single(), ops, pages_per_rank=n, layout=lay)
                for n, lay in ((32, layouts[0]), (40, layouts[1])))
    gen = torch.Generator().manual_seed(5)
    for buf in (r for regs in src.store.regions for r in regs):
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    link = object.__new__(MooncakeLink)
    link.spec = LinkSpec(endpoint=0, cp_size=1, buffers=registered_buffers(src.store))
    link.max_batch, link.retries = max_batch, 0
    link.relayout = None if layouts[0] == layouts[1] else BufferLayout(layouts[1])
    link.local, link.remote_layout = Layout.of(link.spec.buffers), Layout.of(registered_buffers(dec.store))
    link.remote = "127.0.0.1:1"
    link.engine = _CopyEngine()
    link.stats = {"batches": 0, "entries": 0, "largest_batch": 0, "retries": 0, "staged_pieces": 0}
    link.stage = None if stage_bytes is None else HostStaging(link.spec.buffers, stage_bytes)
    link.channel = _Channel()
    return link, src, dec


@pytest.mark.parametrize(("stage_pages", "layers", "pieces"), [
    (100, None, 1),  # the whole part (3 layers x 9 pages) in one piece
    (9, range(0, 3), 3),  # one layer per piece
    (4, range(1, 3), 6),  # smaller than one layer of the part: 3 page ranges per layer
])
def test_staged_send_lands_every_page_bit_exact(stage_pages: int, layers: range | None,
                                                pieces: int) -> None:
    import torch

    part = RankTransfer(request="a", rank=0, runs=(PageRun(first_page=0, num_pages=4, src_slot=3),
                                                   PageRun(first_page=6, num_pages=5, src_slot=20)))
    dst = [10, 11, 12, 30, 31, 32, 33, 0, 1]  # gaps and continuations
    link, src, dec = _staged_link(stage_pages * 512)
    before = [b.clone() for b in dec.store.kv]
    n = link.send_part(part, dst, layers=layers)
    lays = range(3) if layers is None else layers
    assert n == part_nbytes_of(src, 9, lays)
    assert link.stats["staged_pieces"] == pieces
    srcs = [3, 4, 5, 6, 20, 21, 22, 23, 24]
    for layer in range(3):
        for s_, d in zip(srcs, dst, strict=True):
            want = src.store.kv[layer][s_] if layer in lays else before[layer][d]
            assert torch.equal(dec.store.kv[layer][d], want), (layer, s_, d)
        untouched = sorted(set(range(40)) - set(dst))
        assert torch.equal(dec.store.kv[layer][untouched], before[layer][untouched])
    # the sources are the staging buffer, never the pool; runs merged where destinations continue
    lo, hi = link.stage.addr, link.stage.addr + link.stage.nbytes
    assert all(lo <= e[0] and e[0] + e[2] <= hi for b in link.engine.batches for e in b)
    if pieces == 1:
        assert [e[2] // 512 for e in link.engine.batches[0]] == [3, 4, 2] * 3
    link.close()
    assert link.stage is None


@pytest.mark.parametrize("stage_bytes", [None, 100 * 512, 9 * 512, 4 * 512, 512])
def test_layers_of_their_own_page_bytes_land_bit_exact(stage_bytes: int | None) -> None:
    """A pool whose layer 1 holds no index-K (pages of 384 bytes beside 512): each layer's
    region is registered and written at its own page stride, read in place or staged in pieces
    of any size, and the decode pool's pages equal the sender's, nothing else touched."""
    import torch

    part = RankTransfer(request="a", rank=0, runs=(PageRun(first_page=0, num_pages=4, src_slot=3),
                                                   PageRun(first_page=6, num_pages=5, src_slot=20)))
    dst = [10, 11, 12, 30, 31, 32, 33, 0, 1]
    link, src, dec = _staged_link(stage_bytes, mixed=True)
    assert [r.page_bytes for (r,) in link.local.layers] == [512, 384, 512]
    assert link.local.buffers() == [(b.data_ptr(), b.numel()) for b in src.store.kv]
    before = [b.clone() for b in dec.store.kv]
    n = link.send_part(part, dst)
    assert n == 9 * (512 + 384 + 512) == part_nbytes_of(src, 9, range(3))
    assert sum(e[2] for b in link.engine.batches for e in b) == n  # each byte written once
    srcs = [3, 4, 5, 6, 20, 21, 22, 23, 24]
    untouched = sorted(set(range(40)) - set(dst))
    for layer in range(3):
        assert torch.equal(dec.store.kv[layer][dst], src.store.kv[layer][srcs]), layer
        assert torch.equal(dec.store.kv[layer][untouched], before[layer][untouched])


def test_staged_send_checks_the_fence_before_each_batch() -> None:
    part = RankTransfer(request="a", rank=0, runs=(PageRun(first_page=0, num_pages=8, src_slot=0),))
    link, _, _ = _staged_link(2 * 512, max_batch=1)
    checks = iter([False, False, True])
    with pytest.raises(TransferFenced, match=r"fenced: the decode gave grant 3 up; 2 of 24 entries"):
        link.send_part(part, list(range(0, 16, 2)), epoch=3, fenced=lambda: next(checks))
    assert len(link.engine.batches) == 2


def part_nbytes_of(pool: Any, pages: int, layers: range) -> int:
    from cpkv.disagg import part_nbytes

    return part_nbytes(pool.store, pages, layers)


def test_probe_names_a_missing_system_library(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpkv_transfer_mooncake import plugin

    monkeypatch.setattr(plugin, "_can_load", lambda lib: lib != "libibverbs.so.1")
    av = plugin.probe()
    assert not av.available
    assert "libibverbs.so.1 (apt-get install libibverbs1)" in av.reason
    with pytest.raises(RuntimeError, match="libibverbs"):
        plugin.load()


# ---- real engines: C prefill ranks -> one decode rank ------------------------------------------

@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints by architecture, written on first use (``ARCHS``: glm5 has a mixed
    schedule, so its pool's shared layers have smaller pages than its full layers)."""
    return {}


def _tiny(models: dict[str, Path], arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cpkv.models import write_tiny_checkpoint
    from cpkv.models.tiny import ARCHS

    if arch not in models:
        models[arch] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}") / "ckpt",
                                             seed=3, **ARCHS[arch])
    return models[arch]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "prefix", "pipeline", "stage", "arch", "layout"), [
    (2, "zigzag", (20, 0, 3, 64), "request", "auto", "v32", "token_major"),
    (2, "zigzag", (20, 0, 3, 64), "layer", "auto", "v32", "token_major"),
    # host staging on CPU pools, a buffer of 2.5 pages (the tiny model's page is 1792 bytes per
    # layer): every part of more than 2 pages goes in pieces of 2 pages of one layer
    (2, "zigzag", (20, 0, 3, 64), "layer", "host", "v32", "token_major"),
    # GLM-5's mixed schedule: layers of two page sizes (shared layers hold no index-K), each
    # registered and written at its own stride, read in place and staged
    (2, "zigzag", (20, 0, 3, 64), "layer", "auto", "glm5", "token_major"),
    (2, "zigzag", (20, 0, 3, 64), "request", "host", "glm5", "token_major"),
    # the engines' two-part prefill pools: each page re-laid out for the part-major decode
    # pool while staged (latent block, DeepGEMM-ordered index-K -> part-major page)
    (2, "zigzag", (20, 0, 3, 64), "layer", "auto", "glm5", "two_part"),
    pytest.param(2, "zigzag", (20, 0, 3, 64), "request", "host", "v32", "token_major",
                 marks=pytest.mark.slow),
    pytest.param(4, "interleave", (), "layer", "auto", "v32", "token_major",
                 marks=pytest.mark.slow)])
@pytest.mark.slow  # 3.5-4 s a case, 6 cases: whole jobs
def test_mooncake_transfer_and_decode(tiny_models: dict[str, Path],
                                      tmp_path_factory: pytest.TempPathFactory, cp: int,
                                      mode: str, prefix: tuple[int, ...], pipeline: str,
                                      stage: str, arch: str, layout: str) -> None:
    from cpkv.models import load_model

    tiny = _tiny(tiny_models, arch, tmp_path_factory)
    base = helpers.job_spec(tiny, cp, mode, prefix)
    s = base.settings.model_copy(update={"transfer": TransferSettings.model_validate(
        {"name": "mooncake", "timeout_s": 60, "pipeline": pipeline,
         "mooncake": {"stage": stage, "stage_mb": 4480 / (1 << 20)}}),
        "kv": base.settings.kv.model_copy(update={"layout": layout})})
    spec = JobSpec(base.model_dir, base.prompts, s, False, base.prefix_lens, base.decode_tokens)
    out = run_ranks(disagg_rank, cp + 1, args=(spec,), timeout_s=300)
    senders: list[SenderReport] = [r.value for r in out[:cp]]
    dec: DecodeReport = out[cp].value
    model = load_model(str(tiny))
    fmts = model.kv_formats("fp32", helpers.PAGE)
    page_bytes = sum(f.page_bytes for f in fmts)  # each layer in its own format
    if arch == "glm5":
        assert len({f.page_bytes for f in fmts}) == 2
    for r, snd in enumerate(senders):  # exactly the pages each rank owns
        owned = sum(len(v) for v in snd.page_crcs.values())
        assert owned and snd.bytes_sent == owned * page_bytes, f"rank {r}"
        assert dec.bytes_per_rank[r] == snd.bytes_sent
    for rid, crcs in dec.page_crcs.items():  # decode page k == its owner's page k
        owner_crc: dict[int, int] = {}
        for snd in senders:
            owner_crc.update(snd.page_crcs[rid])
        assert crcs == [owner_crc[k] for k in range(len(crcs))], rid
    if pipeline == "layer":
        assert all(snd.overlap_seconds > 0 for snd in senders if snd.bytes_sent)
    assert dec.tokens == helpers.reference_tokens(spec)


# ---- faults ------------------------------------------------------------------------------------

C, TIMEOUT, BIG = 2, 4.0, 2400
FAULTS = ("port", "address", "stall", "over_limit")


def _tables(big: bool) -> tuple[Any, ...]:
    """(prefill ranks' pools, owners, slots, valid length) of a request. ``big``: interleaved
    owners over 2400 pages, so every page is its own piece: 1200 pieces x 2 layers = 2400
    entries per rank (> 2048)."""
    if big:
        ranks, _, _ = helpers.fake_source(C, 1, seed=11)
        for i, r in enumerate(ranks):
            r.pool = _big_pool(r, BIG // C, seed=i)
        return ranks, [k % C for k in range(BIG)], [k // C for k in range(BIG)], BIG * helpers.PAGE
    ranks, owners, slots = helpers.fake_source(C, 12, seed=4)
    return ranks, owners, slots, 12 * helpers.PAGE - 5


def _big_pool(r: Any, n: int, seed: int) -> Any:
    import torch

    from cpkv.kv import ShardedKVPool

    pool = ShardedKVPool(r.pool.fmt, r.pool.num_layers, CPGroup.single(), r.pool.store.ops,
                         pages_per_rank=n)
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.store.kv:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    return pool


def _connect(world: CPGroup, pool: Any, max_batch: int) -> Any:
    from cpkv_transfer_mooncake import plugin

    return plugin.load().connect(LinkSpec(
        endpoint=world.rank, cp_size=C, buffers=registered_buffers(pool.store), timeout_s=TIMEOUT,
        debug=True, options=PluginTable(("transfer", "mooncake"), {
            "max_batch_entries": max_batch, "hostname": "127.0.0.1", "protocol": "tcp"})))


def _decode_side(link: Any, rx: DecodeReceiver, ranks: Any, owners: Any, slots: Any,
                 fault: str) -> dict[str, Any]:
    """Receive the faulty request, record, then receive the next one and check it landed."""
    rec: dict[str, Any] = {}
    before = helpers.pool_snapshot(rx.pages)
    t0 = time.perf_counter()
    try:
        DecodeTransfer(link, rx, C).receive()
        rec["error"] = None
        # only "over_limit" may go through, on an engine that takes the batch (the CUDA 13
        # wheel 0.3.14 takes 2400 entries): then the request must have arrived whole
        helpers.check_landed(rx, ranks, fault, owners, slots)
        rx.free(fault)
        rec["published_whole"] = True
    except TransferError as exc:
        rec["error"] = str(exc)
    rec["seconds"] = time.perf_counter() - t0
    # a sender that has not said it is done may still write: its slots stay in quarantine
    rec["quarantined"] = [pending for _, _, pending in rx.quarantined().values()]
    rec["unchanged"] = (helpers.pool_snapshot(rx.pages)[1] == before[1] and rx.in_flight() == []
                        and (bool(rec["quarantined"]) or helpers.pool_snapshot(rx.pages) == before))
    if fault == "kill":  # rank 1 is gone: the next request is a local one
        helpers.next_request_works(rx)
    else:
        DecodeTransfer(link, rx, C).receive()
        helpers.check_landed(rx, ranks, f"next-{fault}", owners, slots)
        rx.free(f"next-{fault}")
        # the stalled sender's late notice came in during the next request: all slots back
        rec["released"] = (not rx.quarantined() and
                           [sorted(f) for f in rx.pages.allocator.snapshot()] ==
                           [sorted(f) for f in before[0]])
    rec["next_ok"] = True
    return rec


def _apply_fault(link: Any, fault: str) -> Any:
    """Break rank 1's link for one request; returns what undoes it."""
    from cpkv_transfer_mooncake import transport as mt

    if fault == "kill":  # dies after its first batch of 2 entries: part of it written
        real, calls = mt._Engine.write, [0]

        def die_later(self: Any, peer: str, entries: Any) -> int:
            calls[0] += 1
            if calls[0] == 2:
                os._exit(3)
            return real(self, peer, entries)

        mt._Engine.write = die_later  # type: ignore[method-assign]
        return lambda: None
    if fault == "port":  # nothing listens there
        good = link.remote
        link.remote = "127.0.0.1:1"
        return lambda: setattr(link, "remote", good)
    if fault == "address":  # outside every buffer the decode engine registered
        lay = link.remote_layout
        link.remote_layout = replace(lay, layers=tuple(
            tuple(replace(r, addr=r.addr + (1 << 44)) for r in regions) for regions in lay.layers))
        return lambda: setattr(link, "remote_layout", lay)
    if fault == "stall":  # never writes nor notifies within the timeout
        link.send_part = lambda part, dst, **kw: time.sleep(TIMEOUT + 1.5) or 0
        return lambda: delattr(link, "send_part")
    assert fault == "over_limit"  # bypasses the startup check: 2400 entries in one batch
    link.max_batch = 4096
    return lambda: setattr(link, "max_batch", 1024)


def _faults_rank(world: CPGroup, faults: tuple[str, ...], out: str) -> dict[str, Any]:
    """One endpoint of a session of fault requests: for each fault, request ``fault`` suffers it
    (on rank 1), then request ``next-{fault}`` goes through the same links. The decode rank
    records its pool around each and writes the records to ``out``."""
    kill = faults == ("kill",)
    ranks, owners, slots, valid = _tables(big=not kill)
    decode = world.rank == C
    pool = (helpers.torch_pool(CPGroup.single(), capacity=len(owners) + 8) if decode
            else ranks[world.rank].pool)
    link = _connect(world, pool, 2 if kill else 1024)
    recs: dict[str, Any] = {}
    if decode:
        rx = helpers.receiver_of(pool, debug=True)
        for fault in faults:
            recs[fault] = _decode_side(link, rx, ranks, owners, slots, fault)
            Path(out).write_text(json.dumps(recs))
        link.close()
        return recs
    sender = PrefillTransfer(link, pool, world.rank, C, debug=True)
    for fault in faults:
        m = manifest_for(fault, RequestPages(owners, slots, valid), helpers.PAGE, C)
        undo = _apply_fault(link, fault) if world.rank == 1 else (lambda: None)
        rec: dict[str, Any] = {}
        try:
            sender.send(m)
            rec["error"] = None
        except TransferError as exc:
            rec["error"] = str(exc)
        undo()
        link.stats.update(batches=0, entries=0, largest_batch=0)
        sender.send(manifest_for(f"next-{fault}", RequestPages(owners, slots, valid), helpers.PAGE, C))
        rec["stats"] = dict(link.stats)
        recs[fault] = rec
    link.close()
    return recs


@pytest.fixture(scope="module")
def fault_session(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], dict[str, Any]]:
    """All fault requests in one 3-process session (one spawn: the machine is small)."""
    out = tmp_path_factory.mktemp("faults") / "decode.json"
    res = run_ranks(_faults_rank, C + 1, args=(FAULTS, str(out)), timeout_s=120)
    return [r.value for r in res], json.loads(out.read_text())


@pytest.mark.slow  # the shared fault_session fixture spawns the ranks once (~20 s)
@pytest.mark.multiprocess
@pytest.mark.parametrize(("fault", "why"), [
    ("port", r"rank 1's writes failed: .*batch_transfer_sync_write of \d+ entries .* to "
             r"127\.0\.0\.1:1 returned -1"),
    ("address", r"rank 1's writes failed: .*batch_transfer_sync_write .* returned -1"),
    ("stall", r"no completion notice from rank 1 \(waited at most 4 s of silence, transfer\.timeout_s\)"),
    ("over_limit", r"rank 1's writes failed: .*batch_transfer_sync_write of 2400 entries .* "
                   r"returned -1"),
])
def test_fault_publishes_nothing(fault_session: Any, fault: str, why: str) -> None:
    import re

    ranks, recs = fault_session
    dec = recs[fault]
    if fault == "over_limit" and dec["error"] is None:
        # this engine takes a batch over cpkv's limit (Mooncake's CUDA 13 wheel 0.3.14 takes
        # 2400 entries; the non-CUDA 0.3.13 refuses them): nothing to refuse, and the request
        # must have landed whole and correct, its pages given back, the next one landed too
        assert dec["published_whole"] and ranks[1][fault]["error"] is None
        assert dec["next_ok"] and dec["released"] and dec["quarantined"] == []
        for r in (0, 1):
            assert ranks[r][fault]["stats"]["largest_batch"] == 1024
        return
    err = dec["error"] or ""
    assert re.search(why, err), err
    assert f"{fault!r} failed receiving rank 1's part" in err and "nothing published" in err
    assert dec["unchanged"] and dec["next_ok"]  # the next request landed over the same links
    assert f"did not publish request {fault!r}" in (ranks[0][fault]["error"] or "")
    assert ranks[1][fault]["error"], "rank 1 must see its failure"
    assert dec["released"]
    if fault == "stall":
        assert dec["seconds"] < TIMEOUT + 3  # bounded by transfer.timeout_s
        assert dec["quarantined"] == [[1]]  # until rank 1's late notice
    else:
        assert dec["quarantined"] == []  # every sender said it was done
        assert f"failed writing its part of {fault!r}" in ranks[1][fault]["error"]
    # the next request's 2400 entries per rank went in batches within the limit
    for r in (0, 1):
        assert ranks[r][fault]["stats"]["largest_batch"] == 1024
        assert ranks[r][fault]["stats"]["batches"] == 3


@pytest.mark.slow
@pytest.mark.multiprocess
def test_peer_killed_mid_transfer(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    with pytest.raises(RankFailed) as info:
        run_ranks(_faults_rank, C + 1, args=(("kill",), str(out)), timeout_s=60, settle_s=TIMEOUT + 4)
    assert info.value.rank == 1 and info.value.exitcode == 3
    rec = json.loads(out.read_text())["kill"]
    assert "'kill' failed receiving rank 1's part" in rec["error"]
    assert "no completion notice from rank 1" in rec["error"]
    assert "nothing published" in rec["error"]
    assert rec["unchanged"] and rec["next_ok"]


# ---- cpkv run ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpkv_run_with_the_example_config(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "mooncake.toml"
    report = tmp_path / "report.json"
    # without the prefix cache every request keeps its own pages to the end, so what each rank
    # sent is exactly what it holds (with it, shared prefix pages are sent once per request)
    env = {**os.environ, "CPKV_CACHE__ENABLED": "false"}
    res = subprocess.run([sys.executable, "-m", "cpkv.cli", "run", "--config", str(example),
                          "--decode-tokens", "3", "--report", str(report)],
                         capture_output=True, text=True, timeout=300, check=False, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(report.read_text())
    assert rep["transfer"]["plugin"] == "mooncake" and rep["cache"] is None
    assert rep["transfer"]["bytes_per_rank"] == rep["kv_bytes_per_rank"]
    assert rep["decode"]["tokens_match_reference"] is True and rep["correct"] is True
    assert "transfer (mooncake)" in res.stdout


LAYOUTS = ("token_major", "part_major", "two_part")


@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_staged_relayout_lands_every_layout_bit_exact(src_layout: str, dst_layout: str) -> None:
    """Sender and decode pools in any two layouts (fp8, a latent-only layer among full ones):
    a layout the decode does not share is re-laid out while staged, in pieces of a small
    buffer, each region written at its own stride; the decode's pages read back as the same
    canonical blocks as the sender's (each part's token rows alike: latent, index-K values and
    scales), nothing else touched."""
    import torch

    from cpkv.kv.buffers import read_pages

    fp8 = KVFormat(dtype="fp8", page_size=helpers.PAGE, kv_lora_rank=16, rope_dim=8, index_head_dim=8,
                   quant_block=8)
    part = RankTransfer(request="a", rank=0, runs=(PageRun(first_page=0, num_pages=4, src_slot=3),
                                                   PageRun(first_page=6, num_pages=5, src_slot=20)))
    dst = [10, 11, 12, 30, 31, 32, 33, 0, 1]
    link, src, dec = _staged_link(3 * fp8.page_bytes, mixed=True, fmt=fp8,
                                  layouts=(src_layout, dst_layout))
    if src_layout == dst_layout:  # the pools share a layout: the entries read the pool itself
        link.stage = None
    shapes = [[int(r.shape[1]) for r in regs] for regs in dec.store.regions]
    assert [[r.page_bytes for r in regs] for regs in link.remote_layout.layers] == shapes
    before = [read_pages(dec.store.spec, k, torch.arange(40)) for k in range(3)]
    n = link.send_part(part, dst)
    assert n == part_nbytes_of(src, 9, range(3))
    assert sum(e[2] for b in link.engine.batches for e in b) == n  # each byte written once
    srcs, untouched = [3, 4, 5, 6, 20, 21, 22, 23, 24], sorted(set(range(40)) - set(dst))
    for k in range(3):
        got = read_pages(dec.store.spec, k, torch.tensor(dst))
        assert torch.equal(got, read_pages(src.store.spec, k, torch.tensor(srcs))), k
        after = read_pages(dec.store.spec, k, torch.tensor(untouched))
        assert torch.equal(after, before[k][untouched])
