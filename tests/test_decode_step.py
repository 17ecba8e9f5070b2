"""The lean decode step (cpkv.runtime.decoder): equal to greedy decoding through the prefill driver
(CPU, eager), all-or-nothing page growth, requests joining and leaving between steps; on a GPU,
CUDA-graph replays equal to eager steps, and every eager fallback reported."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path

import pytest
import structlog
import torch
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackReason, MaterializeMode, PageLayout
from cpkv.disagg import manifest_for
from cpkv.fallback import recording
from cpkv.kv import PoolExhausted, RequestPages, ShardedKVPool
from cpkv.models import DeepseekV32, write_tiny_checkpoint
from cpkv.models.tiny import ARCHS
from cpkv.runtime.decode import DecodeWorker, decode_step, generate, greedy
from cpkv.runtime.decoder import DecodeShape, bucket_of
from cpkv.runtime.session import PrefillSession
from cpkv.runtime.speculative import speculative_generate
from cpkv.settings import Settings, load_settings
from helpers import deliver

PAGE = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(f"dec-{arch}") / "ckpt", seed=5,
                                 num_nextn_predict_layers=0, **ARCHS[arch])


def _settings(dtype: str, pages: int = 64, **decode: object) -> Settings:
    return load_settings(cp={"size": 1}, kv={"dtype": dtype, "page_size": PAGE,
                                             "pages_per_rank": pages},
                         backend={"preference": ["torch"]}, decode=decode)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [5, PAGE, 3 * PAGE - 3, 2 * PAGE + 1][:n]
    return [torch.randint(0, 200, (k,), generator=g).tolist() for k in lens]


class _Driver:
    """Greedy decoding through the prefill driver (the reference of the lean step)."""

    def __init__(self, model: DeepseekV32, settings: Settings) -> None:
        # the decode pool's settings (DecodeWorker's): one rank, part-major pages, no cache
        one = settings.model_copy(update={
            "kv": settings.kv.model_copy(update={"layout": PageLayout.PART_MAJOR,
                                                 "materialize": MaterializeMode.ALL_GATHER}),
            "cache": settings.cache.model_copy(update={"enabled": False})})
        self.session = PrefillSession(model, one, CPGroup.single())

    def prefill(self, rid: Hashable, ids: list[int]) -> int:
        return greedy(self.session.prefill([(rid, ids)]).last_logits)[0]

    def step(self, batch: Sequence[tuple[Hashable, int]]) -> list[int]:
        return decode_step(self.session, batch)

    def release(self, rid: Hashable) -> None:
        self.session.release(rid)


class _Lean:
    def __init__(self, model: DeepseekV32, settings: Settings, device: str = "cpu") -> None:
        self.worker = DecodeWorker(model, settings, device)
        assert self.worker.decoder is not None

    def prefill(self, rid: Hashable, ids: list[int]) -> int:
        return greedy(self.worker.session.prefill([(rid, ids)]).last_logits)[0]

    def step(self, batch: Sequence[tuple[Hashable, int]]) -> list[int]:
        return self.worker.step(batch)

    def release(self, rid: Hashable) -> None:
        self.worker.release(rid)


def _decode(runner: _Driver | _Lean, steps: int = 14, first: str = "abc",
            leave: tuple[int, str] = (4, "b"), join: tuple[int, str] = (4, "d"),
            ) -> list[list[int]]:
    """Requests ``first`` decode; at step ``leave[0]`` request ``leave[1]`` leaves, at step
    ``join[0]`` request ``join[1]`` joins (default: three requests, after 4 steps one leaves
    and another joins). Prompts by request letter."""
    prompts = dict(zip("abcde", _prompts(4) + _prompts(1, seed=3), strict=True))
    cur = {rid: runner.prefill(rid, prompts[rid]) for rid in first}
    out: list[list[int]] = []
    for t in range(steps):
        if t == leave[0]:
            runner.release(leave[1])
            del cur[leave[1]]
        if t == join[0]:
            cur[join[1]] = runner.prefill(join[1], prompts[join[1]])
        batch = list(cur.items())
        nxt = runner.step(batch)
        out.append(nxt)
        cur = {rid: tok for (rid, _), tok in zip(batch, nxt, strict=True)}
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["two_part", "part_major"])
def test_lean_step_equals_driver_greedy(ckpt: Path, dtype: str, layout: str) -> None:
    """Token for token what a one-token extend through the prefill driver gives, across page
    boundaries (8-token pages), past the indexer's top-16, with requests joining and leaving;
    the decode pool in either layout its kernels read in place (two_part: the indexer reads
    the index-K tensor in DeepGEMM's page order, sparse MLA the latent tensor)."""
    model = DeepseekV32.load(ckpt)
    want = _decode(_Driver(model, _settings(dtype)))
    lean = _Lean(model, _settings(dtype, layout=layout))
    assert lean.worker.pool.store.spec.layout.value == layout
    got = _decode(lean)
    assert got == want


def test_block_table_rows_follow_the_batch(ckpt: Path) -> None:
    """A step uploads only the block-table rows that changed: four requests (one shape, a
    bucket of 4), one leaving after 3 steps (its row now a padding row repeating row 0), a new
    one joining after 6, page boundaries crossed, all as the driver decodes."""
    model = DeepseekV32.load(ckpt)
    want, got = (_decode(runner, 12, first="abcd", leave=(3, "a"), join=(6, "e"))
                 for runner in (_Driver(model, _settings("bf16")),
                                _Lean(model, _settings("bf16"))))
    assert got == want


def test_step_pool_exhausted_changes_nothing(ckpt: Path) -> None:
    model = DeepseekV32.load(ckpt)
    lean = _Lean(model, _settings("bf16", pages=2))  # 2 pages of 8 tokens in the decode pool
    a = lean.prefill("a", list(range(1, PAGE + 1)))  # a full page
    b = lean.prefill("b", list(range(1, PAGE + 1)))  # the other
    pool = lean.worker.pool
    before = {rid: (rp.valid_len, list(rp.slots)) for rid, rp in pool.pages.requests.items()}
    with pytest.raises(PoolExhausted):
        lean.step([("a", a), ("b", b)])  # both need a new page, none is free
    assert {rid: (rp.valid_len, list(rp.slots)) for rid, rp in pool.pages.requests.items()} == before
    lean.release("b")
    assert len(lean.step([("a", a)])) == 1  # a's new page came free


def test_step_rejects_bad_batches(ckpt: Path) -> None:
    model = DeepseekV32.load(ckpt)
    lean = _Lean(model, _settings("bf16"))
    tok = lean.prefill("a", [1, 2, 3])
    with pytest.raises(ValueError, match="at least one request"):
        lean.step([])
    with pytest.raises(ValueError, match="twice"):
        lean.step([("a", tok), ("a", tok)])
    with pytest.raises(KeyError):
        lean.step([("nope", 1)])
    assert lean.worker.pool.pages.requests["a"].valid_len == 3


def test_cpu_steps_are_eager_said_once(ckpt: Path) -> None:
    model = DeepseekV32.load(ckpt)
    lean = _Lean(model, _settings("bf16"))
    tok = lean.prefill("a", [1, 2, 3])
    with structlog.testing.capture_logs() as logs, recording() as rec:
        for _ in range(3):
            tok = lean.step([("a", tok)])[0]
    assert [e["event"] for e in logs].count("cpkv.decode.eager") == 1
    assert not rec.events  # not a fallback: graphs are a CUDA feature
    assert lean.worker.decoder is not None and lean.worker.decoder.last is not None
    assert lean.worker.decoder.last.graph is False


def test_shapes_are_buckets(ckpt: Path) -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert bucket_of(3, 16) == 16
    model = DeepseekV32.load(ckpt)
    lean = _Lean(model, _settings("bf16"))
    toks = [lean.prefill(r, list(range(1, n + 1))) for r, n in (("a", 3), ("b", 17), ("c", 5))]
    lean.step(list(zip("abc", toks, strict=True)))
    dec = lean.worker.decoder
    assert dec is not None and dec.last is not None
    assert dec.last.shape == DecodeShape(batch=4, pages=16)  # 3 -> 4 rows; 18 keys: 3 pages -> 16


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose MTP layer agrees with it (drafts get accepted)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("agree") / "ckpt", seed=3, draft="agree")


def test_mtp_model_lean_step_equals_driver(agree: Path) -> None:
    """With the MTP layer loaded the lean step runs it too (its KV rows written, as the driver
    writes them): tokens and then speculative decoding equal on both."""
    model = DeepseekV32.load(agree, mtp=True)
    assert _decode(_Lean(model, _settings("bf16"))) == _decode(_Driver(model, _settings("bf16")))


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: 12 CPU s
def test_lean_speculation_equals_plain_greedy(agree: Path, k: int) -> None:
    """Speculative decoding on lean verify/draft steps: the tokens of plain greedy decoding,
    the same acceptance as on the driver's steps."""
    model = DeepseekV32.load(agree, mtp=True)
    prompts = _prompts(3, seed=1)
    runs = []
    for runner in (_Lean(model, _settings("bf16")), _Driver(model, _settings("bf16"))):
        first = []
        for i, ids in enumerate(prompts):
            if isinstance(runner, _Lean):
                res = runner.worker.session.prefill([(f"r{i}", ids)])
            else:
                res = runner.session.prefill([(f"r{i}", ids)])
            assert res.draft_logits is not None
            first.append((f"r{i}", greedy(res.last_logits)[0], greedy(res.draft_logits)[0]))
        if isinstance(runner, _Lean):
            tokens, stats = runner.worker.speculate(first, 12, draft_tokens=k)
        else:
            tokens, stats = speculative_generate(runner.session, first, 12, draft_tokens=k)
        runs.append((tokens, stats.accepted, stats.steps))
    assert runs[0] == runs[1]
    assert runs[0][1] > 0  # drafts were accepted: the verify path was exercised
    plain = _Driver(model, _settings("bf16"))
    cur = [(rid, tok) for rid, tok, _ in first]
    for rid, ids in zip((r for r, _, _ in first), prompts, strict=True):
        plain.prefill(rid, ids)
    want = [[tok] for _, tok in cur]
    for _ in range(11):
        nxt = plain.step(cur)
        for w, t in zip(want, nxt, strict=True):
            w.append(t)
        cur = [(rid, t) for (rid, _), t in zip(cur, nxt, strict=True)]
    assert runs[0][0] == want


class _Source:
    """A prefill rank as the transfer helpers see it (its pool)."""

    def __init__(self, pool: ShardedKVPool) -> None:
        self.pool = pool


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_transferred_request_decodes_the_same(ckpt: Path, device: str) -> None:
    """A request prefilled on a (token-major) prefill pool and received by the decode worker
    (reserve, pages placed, complete: the transfer protocol without a network) decodes the
    tokens the prefill session's own driver decodes (CPU: the float32 reference ops); on a GPU,
    from CUDA-graph replays, the tokens of eager steps on the same received pages (the driver's
    kernels round differently there: FlashMLA's prefill kernel instead of its decode kernel)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = DeepseekV32.load(ckpt, dtype=dtype, device=device)
    s = _settings("fp8")
    prefill = PrefillSession(model, s, CPGroup.single(device))
    first = greedy(prefill.prefill([("a", _prompts(3)[2])]).last_logits)[0]
    rp = prefill.pool.pages.requests["a"]
    m = manifest_for("a", RequestPages(list(rp.owners), list(rp.slots), rp.valid_len), PAGE, 1)

    def received(settings: Settings) -> DecodeWorker:
        worker = DecodeWorker(model, settings, device)
        worker.receiver.reserve(m)
        assert worker.receiver.complete(m, deliver(worker.receiver, [_Source(prefill.pool)], m))
        return worker

    worker = received(s)
    got = worker.generate([("a", first)], 20)
    if device == "cuda":
        eager = received(s.model_copy(update={"decode": s.decode.model_copy(
            update={"cuda_graphs": False})}))
        want = eager.generate([("a", first)], 20)
    else:
        want = generate(prefill, [("a", first)], 20)
    assert got == want
    assert worker.decoder.last is not None and worker.decoder.last.graph is (device == "cuda")


# ---- GPU: graphs --------------------------------------------------------------------------------
def _gpu_settings(**decode: object) -> Settings:
    # 4-token pages: the block table outgrows its first width (16 pages) within the test
    return load_settings(cp={"size": 1}, kv={"dtype": "fp8", "page_size": 4, "pages_per_rank": 256},
                         decode=decode)


@pytest.mark.gpu
def test_graph_replay_equals_eager(ckpt: Path) -> None:
    """The same tokens from CUDA-graph replays as from eager steps (several buckets, a block
    table that grows past its first width, requests joining and leaving)."""
    model = DeepseekV32.load(ckpt, dtype=torch.bfloat16, device="cuda")
    eager = _Lean(model, _gpu_settings(cuda_graphs=False), "cuda")
    graphs = _Lean(model, _gpu_settings(), "cuda")
    with recording() as rec:
        want = _decode(eager, steps=48)
    said = [e for e in rec.events if e.reason is FallbackReason.DECODE_EAGER]
    assert len(said) == 1 and "decode.cuda_graphs = false" in said[0].detail
    with recording() as rec:
        got = _decode(graphs, steps=48)
    assert not [e for e in rec.events if e.reason is FallbackReason.DECODE_EAGER]
    dec = graphs.worker.decoder
    assert dec is not None and dec.last is not None and dec.last.graph
    assert dec.captures >= 2
    assert got == want


@pytest.mark.gpu
def test_failed_capture_runs_eagerly_reported(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = DeepseekV32.load(ckpt, dtype=torch.bfloat16, device="cuda")
    want = _decode(_Lean(model, _gpu_settings(cuda_graphs=False), "cuda"), steps=6)

    def refuse(*_a: object, **_k: object) -> None:
        raise RuntimeError("capture refused (test)")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    lean = _Lean(model, _gpu_settings(), "cuda")
    with recording() as rec:
        got = _decode(lean, steps=6)
    assert got == want
    said = [e for e in rec.events if e.reason is FallbackReason.DECODE_EAGER]
    assert said and all("capture refused (test)" in e.detail for e in said)


@hyp_settings(max_examples=60, deadline=None)
@given(st.data())
def test_page_rows_maps_request_keys_to_token_rows(data: st.DataObject) -> None:
    """The reference ``page_rows`` (the decode step's picks to token rows): request-local key j
    of a row -> ``table[request[row], j // S] * S + j % S``, int32; -1 (an empty pick) stays
    -1, every page size and key."""
    from cpkv.testing.conformance import reference_backend

    s = data.draw(st.sampled_from([1, 2, 16, 64]))
    b, m, r, k = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6)),
                  data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    table = torch.randint(0, 1000, (b, m), generator=g, dtype=torch.int32)
    request = torch.arange(b, dtype=torch.int32).repeat_interleave(r)
    top = torch.randint(-1, m * s, (b * r, k), generator=g, dtype=torch.int32)
    got = reference_backend().page_rows(top, table, request, s)
    assert got.dtype == torch.int32
    for i in range(b * r):
        for c in range(k):
            j = int(top[i, c])
            want = -1 if j < 0 else int(table[i // r, j // s]) * s + j % s
            assert int(got[i, c]) == want
