"""The layer-pipelined transfer inside one prefill session (one process, a recording link): layer
l's pages are queued right after layer l's KV write, with no host sync in the layer loop, the
queued bytes stay within ``transfer.max_inflight_mb``, the bytes sent are exactly the pages'
bytes, and a failed prefill tells the decode at once."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.disagg import Ack, Done, Grant, Offer, PrefillTransfer, RankTransfer, TransferError
from cpkv.fallback import recording
from cpkv.models import load_model, write_tiny_checkpoint
from cpkv.runtime.prefill import CPPrefill
from cpkv.runtime.session import PrefillSession
from cpkv.settings import load_settings
from cpkv_backend_torch import ops as torch_ops

PAGE = 8


class _HostSync(AssertionError):
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3)


class _Decode:
    """A side channel and one-sided link that play the decode: grant every offer, acknowledge
    every Done; ``send_part`` copies the pages it is asked to send and records when."""

    one_sided = True
    writes_receiver_layout = False
    timeout_s = 30.0

    def __init__(self, pool: Any, refuse: int = 0) -> None:
        self.pool, self.refuse = pool, refuse
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.messages: list[Any] = []
        self.sends: list[tuple[int, float, int]] = []  # (first layer, time, bytes)
        self.copies: dict[int, torch.Tensor] = {}  # layer -> the sent pages' bytes
        self.channel = self
        self.lock = threading.Lock()

    # side channel
    def send(self, peer: int, msg: Any) -> None:
        with self.lock:
            self.messages.append(msg)
        if isinstance(msg, Offer) and self.refuse:
            self.refuse -= 1
            self.inbox.put(Grant(msg.manifest.request, None, "the decode pool is full"))
        elif isinstance(msg, Offer):
            part = next((p for p in msg.manifest.parts if p.rank == 0), None)
            n = part.num_pages if part else 0
            self.inbox.put(Grant(msg.manifest.request, list(range(n)), epoch=7))
        elif isinstance(msg, Done):
            self.inbox.put(Ack(msg.request, msg.error is None, msg.error, time.time()))

    def recv(self, peer: int) -> Any:
        return self.inbox.get(timeout=30)

    # link
    def send_part(self, part: RankTransfer, dst: Any, *, layers: range | None = None,
                  epoch: int = 0, fenced: Any = None) -> int:
        assert epoch == 7 and layers is not None
        src = torch.tensor([r.src_slot + i for r in part.runs for i in range(r.num_pages)])
        n = 0
        for layer in layers:
            self.copies[layer] = self.pool.store.kv[layer].index_select(0, src).clone()
            n += self.copies[layer].numel()
        self.sends.append((layers[0], time.perf_counter(), n))
        return n

    def recv_part(self, *a: Any, **k: Any) -> int:
        return 0

    def close(self) -> None:
        pass


def _session(tiny: Path, inflight_mb: int = 256, refuse: int = 0,
             ) -> tuple[PrefillSession, _Decode]:
    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]},
                      transfer={"pipeline": "layer", "max_inflight_mb": inflight_mb})
    with recording():
        session = PrefillSession(load_model(str(tiny)), s, CPGroup.single())
    dec = _Decode(session.pool, refuse)
    session._sender = PrefillTransfer(dec, session.pool, 0, 1,  # type: ignore[arg-type]
                                      max_inflight_bytes=inflight_mb << 20)
    return session, dec


def _guard_layers(monkeypatch: pytest.MonkeyPatch, written: list[float]) -> None:
    """Tensor reads to the host raise inside the layer loop (of this thread: the sender worker
    reads pages on its own thread, which is the point); each layer's write is timed."""
    real_layers, main = CPPrefill._layers, threading.get_ident()

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        def sync(name: str) -> Any:
            real = getattr(torch.Tensor, name)

            def check(t: Any, *a: Any, **k: Any) -> Any:
                if threading.get_ident() == main:
                    raise _HostSync(f"host sync ({name}) inside the CP layer loop")
                return real(t, *a, **k)

            return check

        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "__int__", "__float__", "__bool__", "nonzero", "cpu",
                         "numpy"):
                mp.setattr(torch.Tensor, name, sync(name))
            real_write = self.pool.write

            def write(layer: int, *a: Any, **k: Any) -> None:
                real_write(layer, *a, **k)
                written.append(time.perf_counter())

            mp.setattr(self.pool, "write", write)
            return real_layers(self, *args, **kwargs)

    monkeypatch.setattr(CPPrefill, "_layers", guarded)
    # the torch reference's CPU-only shortcut reads key bounds (host ints): off, so the guard
    # checks the path a GPU takes
    monkeypatch.setattr(torch_ops, "READ_HOST_BOUNDS", False)


def test_each_layer_moves_after_its_write_without_a_host_sync(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session, dec = _session(tiny)
    written: list[float] = []
    _guard_layers(monkeypatch, written)
    prompt = [(i * 37) % 500 for i in range(93)]
    with recording():
        session.prefill([("a", prompt)], send={"a": True})
    sent = session.send("a", meta={"first_token": 5})
    layers = session.model.num_layers
    assert [s[0] for s in dec.sends] == list(range(layers))  # one send per layer, in order
    for layer, t, _ in dec.sends:
        assert t >= written[layer]  # never before that layer's KV was written
    rp = session.pages("a")
    page_bytes = session.pool.store.kv[0][0].numel()
    assert sent.nbytes == len(rp.slots) * page_bytes * layers == sum(s[2] for s in dec.sends)
    for layer in range(layers):  # the pages as they are at the end: nothing sent early
        assert torch.equal(dec.copies[layer], session.pool.store.kv[layer][torch.tensor(rp.slots)])
    done = [m for m in dec.messages if isinstance(m, Done)]
    assert done[0].meta == {"first_token": 5} and done[0].nbytes == sent.nbytes
    offer = next(m for m in dec.messages if isinstance(m, Offer))
    assert offer.pipeline == "layer" and offer.manifest.valid_len == 93
    assert sent.pipeline == "layer" and sent.ready_seconds > 0
    session.close()


def test_queued_bytes_stay_within_the_bound(tiny: Path) -> None:
    session, dec = _session(tiny, inflight_mb=1)
    prompt = [(i * 11) % 500 for i in range(90)]
    layer_bytes = 0
    with recording():
        session.prefill([("a", prompt)], send={"a": True})
    session.send("a")
    layer_bytes = max(s[2] for s in dec.sends)
    worker = session._sender.worker  # type: ignore[union-attr]
    assert layer_bytes < 1 << 20 and worker.peak_inflight <= 1 << 20
    session.close()


def test_a_failed_prefill_tells_the_decode_at_once(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                    ) -> None:
    session, dec = _session(tiny)
    real = session.model.mlp

    def boom(layer: int, x: Any, norm: Any = None) -> Any:
        if layer == 1:
            raise RuntimeError("out of memory (simulated)")
        return real(layer, x, norm)

    monkeypatch.setattr(session.model, "mlp", boom)
    with recording(), pytest.raises(RuntimeError, match="simulated"):
        session.prefill([("a", list(range(40)))], send={"a": True})
    done = [m for m in dec.messages if isinstance(m, Done)]
    assert len(done) == 1 and "prefill of the batch failed" in (done[0].error or "")
    assert not session._sender.open  # type: ignore[union-attr]
    with pytest.raises(TransferError):  # nothing is left open for this request
        session._sender.finish("a")  # type: ignore[union-attr]


def test_a_refused_offer_does_not_fail_the_prefill(tiny: Path) -> None:
    """The decode refused the layer-pipelined offer: the prefill completes, and send() offers
    the request again after it, whole."""
    session, dec = _session(tiny, refuse=1)
    with recording():
        res = session.prefill([("a", list(range(50)))], send={"a": True})
    assert torch.isfinite(res.last_logits).all() and not dec.sends
    sent = session.send("a")
    assert sent.pipeline == "request" and [s[0] for s in dec.sends] == [0]
    offers = [m for m in dec.messages if isinstance(m, Offer)]
    assert [o.pipeline for o in offers] == ["layer", "request"]
    session.close()
