"""Late writes (docs/transfer.md, "Late writes"): a prefill sender stalls past the decode side's
timeout, the decode side gives the request up and serves the next one in the same pool, then the
stalled sender wakes and writes. The next request's pages must be exactly its senders' pages
(CRC32 per page), for both transfer plugins; without the quarantine the same run corrupts them.

Request "A": every page owned by rank 1 (its late write covers every slot A had). Request "B":
pages alternate between the ranks, so B's rank-0 pages sit in slots A had when the decode reuses
them. Rank 1's sender stalls ``STALL`` s (> ``TIMEOUT``) in A's part, either inside the write
(after the fence check: the bytes land late) or before it (the fence stops it)."""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from cpkv.comm import CPGroup
from cpkv.disagg import (
    DecodeReceiver,
    DecodeTransfer,
    LinkSpec,
    PrefillTransfer,
    TransferError,
    manifest_for,
    registered_buffers,
)
from cpkv.kv import RequestPages
from cpkv.runtime import run_ranks
from cpkv.settings import PluginTable
from cpkv_transfer_mooncake.plugin import probe
from helpers import PAGE, FakeRank, receiver_of, torch_pool

C, TIMEOUT, STALL, N = 2, 3.0, 5.0, 12
_MOONCAKE = probe()
needs_mooncake = pytest.mark.skipif(not _MOONCAKE.available, reason=f"mooncake: {_MOONCAKE.reason}")


def _tables() -> dict[str, RequestPages]:
    a = RequestPages([1] * N, list(range(N)), N * PAGE - 3)
    b = RequestPages([k % 2 for k in range(N)], [16 + k // 2 for k in range(N)], N * PAGE - 5)
    return {"A": a, "B": b}


def _page_crc(pool: Any, slot: int) -> int:
    raw = b"".join(pool.store.kv[layer][slot].numpy().tobytes() for layer in range(pool.num_layers))
    return zlib.crc32(raw)


def _stall(link: Any, where: str) -> None:
    """Rank 1's sends of request A stall: ``write`` inside the engine write (after the fence
    check, so its bytes land late), ``send`` before the part's first batch."""
    real_send = link.send_part
    state = {"request": ""}

    def send(part: Any, dst: Any, **kw: Any) -> int:
        state["request"] = part.request
        if where == "send" and part.request == "A":
            time.sleep(STALL)
        return real_send(part, dst, **kw)

    link.send_part = send
    if where == "write":
        real_write = link._write

        def write(batch: Any) -> None:
            if state["request"] == "A":
                time.sleep(STALL)
            real_write(batch)

        link._write = write


def _connect(world: CPGroup, plugin: str, pool: Any, stage: str = "auto") -> Any:
    """``stage``: mooncake's ``transfer.mooncake.stage``, or ``"host-pieces"``: host staging
    through a buffer of 5 pages of 512 bytes (A's 12 pages x 2 layers go in 6 pieces)."""
    opts: dict[str, Any] = {"hostname": "127.0.0.1"}
    if plugin == "mooncake":
        opts.update(protocol="tcp", stage=stage)
    if stage == "host-pieces":
        opts.update(stage="host", stage_mb=2560 / (1 << 20))
    from cpkv.plugin import PluginHost

    host = PluginHost(allow=[plugin])
    try:
        transport = host.transfers().select([plugin])["transfer"].impl
    finally:
        host.close()
    return transport.connect(LinkSpec(endpoint=world.rank, cp_size=C,
                                      buffers=registered_buffers(pool.store), timeout_s=TIMEOUT,
                                      debug=False, options=PluginTable(("transfer", plugin), opts)))


def _late_rank(world: CPGroup, plugin: str, where: str, quarantine: bool, out: str,
               stage: str = "auto") -> Any:
    ranks = [FakeRank(seed=40 + r) for r in range(C)]
    tables = _tables()
    if world.rank == C:
        pool = torch_pool(CPGroup.single(), capacity=2 * N + 4)
        link = _connect(world, plugin, pool, stage)
        rx = receiver_of(pool, debug=False)
        if not quarantine:  # what the decode did before: give the slots back at once
            rx.abort = lambda m, hold=(), epoch=0: DecodeReceiver.abort(rx, m)  # type: ignore[method-assign]
        dt = DecodeTransfer(link, rx, C)
        rec: dict[str, Any] = {"reserved": []}
        real_reserve = rx.reserve

        def reserve(m: Any) -> dict[int, int]:
            slots = real_reserve(m)
            rec["reserved"].append(sorted(slots.values()))
            return slots

        rx.reserve = reserve  # type: ignore[method-assign]
        try:
            dt.receive()
        except TransferError as exc:
            rec["error_a"] = str(exc)
        rec["quarantined"] = [(req, slots, pending) for req, slots, pending
                              in rx.quarantined().values()]
        a_slots = rec["quarantined"][0][1] if rec["quarantined"] else []
        got = dt.receive()  # B, while rank 1 still stalls in A
        rp = pool.pages.requests["B"]
        want = [_page_crc(ranks[o].pool, s) for o, s in zip(tables["B"].owners,
                                                             tables["B"].slots, strict=True)]
        rec["b_slots"] = list(rp.slots)
        rec["b_ok_at_publish"] = [_page_crc(pool, s) for s in rp.slots] == want
        rec["late"] = [(d.request, d.nbytes, d.error) for d in dt.late]
        time.sleep(1.0)  # anything still in flight lands now
        rec["b_ok_after"] = [_page_crc(pool, s) for s in rp.slots] == want
        # with the quarantine the late bytes landed in A's old slots: rank 1's A pages
        rec["a_landed"] = bool(a_slots) and [_page_crc(pool, s) for s in a_slots] == [
            _page_crc(ranks[1].pool, s) for s in tables["A"].slots]
        rec["quarantine_after"] = len(rx.quarantined())
        rec["bytes_b"] = got.bytes_per_rank
        Path(out).write_text(json.dumps(rec))
        return rec
    pool = ranks[world.rank].pool
    link = _connect(world, plugin, pool, stage)
    if world.rank == 1:
        _stall(link, where)
    sender = PrefillTransfer(link, pool, world.rank, C)
    res: dict[str, Any] = {}
    for rid in ("A", "B"):
        try:
            sender.send(manifest_for(rid, tables[rid], PAGE, C))
            res[rid] = None
        except TransferError as exc:
            res[rid] = str(exc)
    sender.close()
    return res


def _run(tmp_path: Path, plugin: str, where: str, quarantine: bool = True,
         stage: str = "auto") -> tuple[Any, Any]:
    out = tmp_path / "decode.json"
    res = run_ranks(_late_rank, C + 1, args=(plugin, where, quarantine, str(out), stage),
                    timeout_s=120)
    return [r.value for r in res[:C]], json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.mooncake
@needs_mooncake
# "host": A's part staged whole (one piece: the stall sits in its only batch, as unstaged)
# (8 s of stalls and timeouts on 2 cores each: slow, CI runs them)
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["auto", "host"])
def test_mooncake_late_write_lands_in_quarantine(tmp_path: Path, stage: str) -> None:
    senders, dec = _run(tmp_path, "mooncake", "write", stage=stage)
    assert "no completion notice from rank 1" in dec["error_a"]
    assert "did not publish request 'A'" in senders[0]["A"] and senders[0]["B"] is None
    req, slots, pending = dec["quarantined"][0]
    assert req == "A" and pending == [1] and len(slots) == N
    assert not set(slots) & set(dec["b_slots"])  # B got other memory
    # the stalled sender woke and wrote all of A (its late notice says so, and the bytes are
    # there), yet every page of B is its senders' page
    assert dec["late"] == [["A", N * dec["bytes_b"][1] // (N // 2), None]]
    assert dec["a_landed"]
    assert dec["b_ok_at_publish"] and dec["b_ok_after"]
    assert dec["quarantine_after"] == 0  # the late notice gave A's slots back


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.mooncake
@needs_mooncake
def test_without_the_quarantine_the_late_write_corrupts_the_next_request(tmp_path: Path) -> None:
    """The control: the same run with the slots given back at once (the old behaviour)."""
    _, dec = _run(tmp_path, "mooncake", "write", quarantine=False)
    assert dec["quarantined"] == []
    assert set(dec["reserved"][0]) & set(dec["b_slots"])  # B got A's memory
    assert dec["b_ok_at_publish"] is False  # published, and silently wrong


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.mooncake
@needs_mooncake
@pytest.mark.parametrize("stage", ["auto", "host-pieces"])
def test_a_stalled_sender_checks_the_fence_and_writes_nothing(tmp_path: Path, stage: str) -> None:
    _, dec = _run(tmp_path, "mooncake", "send", stage=stage)
    assert dec["late"][0][0] == "A" and "fenced" in (dec["late"][0][2] or "")
    assert dec["late"][0][1] == 0  # not one byte of A after the fence
    assert not dec["a_landed"]
    assert dec["b_ok_at_publish"] and dec["b_ok_after"] and dec["quarantine_after"] == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_nccl_late_send_never_reaches_the_pool(tmp_path: Path) -> None:
    """Two-sided: the decode reuses A's memory for B at once; A's late bytes land in the staging
    buffer of the receive the decode gave up (still posted, tagged with A's grant), and B's
    receives take only B's messages."""
    senders, dec = _run(tmp_path, "nccl", "send")
    assert "did not arrive, and no endpoint made progress, for 3 s" in dec["error_a"]
    assert dec["quarantined"] == []
    assert set(dec["reserved"][0]) & set(dec["b_slots"])  # B got A's memory
    assert "did not publish request 'A'" in senders[0]["A"] and senders[1]["B"] is None
    assert dec["late"] and dec["late"][0][0] == "A" and dec["late"][0][2] is None  # it did send
    assert dec["b_ok_at_publish"] and dec["b_ok_after"]
