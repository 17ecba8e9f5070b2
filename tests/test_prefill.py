"""CP prefill of a real (tiny, random) DeepSeek-V3.2 or GLM-5 checkpoint equals the single-rank
run (contract rule 23): logits within 1e-4 relative in float32, identical top-k sets up to ties
(GLM-5's shared-indexer layers reuse the last full layer's choice in the same view coordinates)."""

from __future__ import annotations

import random
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.contracts import SplitMode
from cpkv.fallback import recording
from cpkv.models import write_tiny_checkpoint
from cpkv.models.tiny import ARCHS
from cpkv.runtime import run_ranks
from cpkv.runtime.job import JobSpec, compare_topk, prefill_rank
from cpkv.settings import load_settings
from cpkv_backend_torch import ops as torch_ops

PAGE = 8  # small pages so that short prompts still span many pages


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}") / "ckpt", seed=3,
                                 **ARCHS[arch])


def _prompts(seed: int, lengths: list[int], vocab: int = 512) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(seed)
    return tuple(tuple(rng.randrange(vocab) for _ in range(n)) for n in lengths)


def _cases(cp: int, arch: str = "v32") -> list[tuple[str, JobSpec]]:
    """Both modes; batches without and with cached prefixes (ending mid-page). GLM-5 (the same
    machinery, its shared layers on top): the prefix cases, fp32 and the p2p fp8 pool, both
    modes."""
    prompts = _prompts(cp, [90, 45, 7, 130])
    out = []
    for mode in SplitMode:
        for prefix in [(), (20, 0, 3, 64)]:  # 20 and 3 end mid-page, 64 on a page boundary
            s = load_settings(cp={"size": cp, "mode": mode}, kv={"page_size": PAGE, "dtype": "fp32"},
                              backend={"preference": ["torch"]}, runtime={"logits_budget_mb": 1})
            out.append((f"{mode.value} prefix={prefix}", JobSpec("", prompts, s, True, prefix)))
        if cp in (2, 4):  # the P2P full view (shared memory between the Gloo ranks), fp8 pool
            s = load_settings(cp={"size": cp, "mode": mode},
                              kv={"page_size": PAGE, "dtype": "fp8", "materialize": "p2p"},
                              backend={"preference": ["torch"]}, runtime={"logits_budget_mb": 1})
            out.append((f"{mode.value} p2p fp8 prefix", JobSpec("", prompts, s, True,
                                                                (20, 0, 3, 64))))
            # DeepSeek's fp8 indexer: rotated ue8m0 index-K, rotated fp8 queries
            s = load_settings(cp={"size": cp, "mode": mode}, kv={"page_size": PAGE, "dtype": "fp8"},
                              backend={"preference": ["torch"]},
                              runtime={"logits_budget_mb": 1, "indexer_dtype": "fp8"})
            out.append((f"{mode.value} fp8 indexer prefix", JobSpec("", prompts, s, True,
                                                                    (20, 0, 3, 64))))
    return out if arch == "v32" else [c for i, c in enumerate(out) if i % 4 in (1, 2)]


def _run_cases(group: CPGroup, model_dir: str, cases: list[tuple[str, JobSpec]]) -> list:  # type: ignore[type-arg]
    return [prefill_rank(group, JobSpec(model_dir, s.prompts, s.settings, True, s.prefix_lens))
            for _, s in cases]


def _reference(model_dir: str, spec: JobSpec):  # type: ignore[no-untyped-def]
    one = spec.settings.model_copy(update={"cp": spec.settings.cp.model_copy(update={"size": 1})})
    with recording():
        return prefill_rank(CPGroup.single(), JobSpec(model_dir, spec.prompts, one, True,
                                                      spec.prefix_lens))


def _check(cp_rank0, ref, name: str) -> None:  # type: ignore[no-untyped-def]
    a, b = cp_rank0.last_logits, ref.last_logits
    rel = ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()
    assert rel <= 1e-4, f"{name}: logits differ by {rel:.2e} relative"
    bad = compare_topk(cp_rank0.topk_indices, cp_rank0.topk_scores, ref.topk_indices,
                       ref.topk_scores)
    assert bad == 0, f"{name}: {bad} rows chose different top-k sets"


def test_single_rank_prefill_with_prefix_equals_without(tiny: Path) -> None:
    """C = 1: prefilling a prompt in two batches (prefix from the cache) equals one batch."""
    _, spec = _cases(1)[0]
    whole = _reference(str(tiny), spec)
    split = _reference(str(tiny), JobSpec("", spec.prompts, spec.settings, True, (20, 0, 3, 64)))
    assert torch.allclose(whole.last_logits, split.last_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow),
                                pytest.param(8, marks=pytest.mark.slow)])
def test_cp_prefill_equals_single_rank(cp: int, tiny: Path, arch: str) -> None:
    cases = _cases(cp, arch)
    results = run_ranks(_run_cases, cp, args=(str(tiny), cases), timeout_s=300)
    for i, (name, spec) in enumerate(cases):
        ref = _reference(str(tiny), spec)
        _check(results[0].value[i], ref, f"CP{cp} {name}")
        want = spec.settings.kv.materialize
        if want == "auto":  # CPU ranks: auto is all_gather (docs/kv-pool.md)
            want = "all_gather"
        assert [r.value[i].materialize for r in results] == [want] * cp
        # every rank holds about 1/C of the KV and together exactly the logical footprint
        held = [r.value[i].kv_bytes for r in results]
        assert sum(held) == results[0].value[i].kv_bytes_replicated


class _HostSync(AssertionError):
    pass


@pytest.mark.parametrize("mtp", [False, True])
def test_layer_loop_has_no_host_sync(tiny: Path, monkeypatch: pytest.MonkeyPatch, mtp: bool) -> None:
    """Rule 22: nothing in the per-layer path reads a device value back to the host; with the
    MTP layer loaded, nor does the draft layer (its embedding, the layer, shared_head)."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp8"},
                      backend={"preference": ["torch"]})
    with recording():
        session = PrefillSession(load_model(str(tiny), mtp=mtp), s, CPGroup.single())
    guarded_calls: list[str] = []

    @contextmanager
    def guard(part: str) -> Iterator[None]:
        """The driver's public sync-free hook: fail on any host read inside the region."""
        def sync(*_a, **_k):  # type: ignore[no-untyped-def]
            raise _HostSync(f"host sync inside the driver's {part!r} region")

        guarded_calls.append(part)
        with monkeypatch.context() as mp:
            for attr in ("item", "tolist", "__int__", "__float__", "__bool__", "nonzero", "cpu",
                         "numpy"):
                mp.setattr(torch.Tensor, attr, sync)
            yield

    # the torch reference's CPU-only shortcut reads key bounds (host ints, no device): off, so
    # the guard checks the path a GPU takes
    monkeypatch.setattr(torch_ops, "READ_HOST_BOUNDS", False)
    session.driver.sync_free_region = guard
    prompts = _prompts(5, [90, 33])
    with recording():
        res = session.prefill([("a", prompts[0]), ("b", prompts[1])])
        res2 = session.prefill([("a", prompts[1])])  # continues "a" from a mid-page prefix
        res3 = session.prefill([("a", [7]), ("b", [9])])  # decode-like: selected latent rows
    assert torch.isfinite(res.last_logits).all() and torch.isfinite(res2.last_logits).all()
    assert torch.isfinite(res3.last_logits).all()
    assert "layers" in guarded_calls and ("draft" in guarded_calls) == mtp
    if mtp:
        assert res.draft_logits is not None and torch.isfinite(res.draft_logits).all()


@pytest.mark.slow_on_arch("glm5")  # 8-8.5 CPU seconds each on glm5, 2.6-3.8 on v32
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_selected_latent_rows_equal_the_whole_view(tiny: Path, dtype: str) -> None:
    """A batch that reads fewer latent rows than its view holds (decode steps) dequantizes only
    the rows its top-k picks, or on part-major pages (the decode pool's) reads them in place
    (``sparse_mla_paged``); logits and choices equal dequantizing the whole view."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": dtype},
                      backend={"preference": ["torch"]})
    model = load_model(str(tiny))
    prompt = _prompts(8, [150])[0]
    from cpkv.kv import FullView

    real = FullView.selected_latent
    out, picked, selected = [], [], []
    for select, layout in ((None, "token_major"), (False, "token_major"), (None, "part_major")):
        sl = s.model_copy(update={"kv": s.kv.model_copy(update={"layout": layout})})
        with recording():
            session = PrefillSession(model, sl, CPGroup.single())
        session.driver.select_latent = select
        session.prefill([("a", prompt[:140])])
        rows: list[int] = []

        def spy(self: FullView, top: torch.Tensor, *a: Any, _rows: list[int] = rows) -> Any:
            _rows.append(top.numel())
            return real(self, top, *a)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(FullView, "selected_latent", spy)
            res = [session.prefill([("a", [tok])], capture_topk=True)  # one-token steps:
                   for tok in prompt[140:]]  # 1 row x top-16 < the view's 141+ keys
        out.append(torch.cat([r.last_logits for r in res]))
        picked.append([t for r in res for t in r.topk.indices])
        selected.append(rows)
    assert selected[0] == [16] * 10 * model.num_layers and selected[1] == []  # auto picks rows
    assert selected[2] == []  # part-major pages (the decode pool's): read in place, paged op
    for other in (1, 2):
        assert torch.equal(out[0], out[other])
        assert all(torch.equal(a, b) for a, b in zip(picked[0], picked[other], strict=True))


@pytest.mark.slow_on_arch("glm5")  # 13.6 CPU seconds on glm5, 4.9 on v32
def test_indexer_logits_chunking_does_not_change_results(tiny: Path) -> None:
    """Rule 21: a budget that forces one row per chunk gives the same logits and top-k."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]})
    model = load_model(str(tiny))
    prompt = _prompts(6, [70])[0]
    out = []
    for budget in (256 << 20, 1):  # one chunk; one row per chunk
        with recording():
            session = PrefillSession(model, s, CPGroup.single())
        session.driver.budget = budget
        out.append(session.prefill([("a", prompt)], capture_topk=True))
    # row chunks change matmul shapes, hence the last bits (CPU BLAS is not batch-invariant)
    assert torch.allclose(out[0].last_logits, out[1].last_logits, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(out[0].topk.indices, out[1].topk.indices,
                                                 strict=True))


def test_without_a_capture_the_choice_is_one_indexer_topk_op(tiny: Path) -> None:
    """Without ``capture_topk`` each row chunk's choice is one ``indexer_topk`` call (a backend
    may then never store the logits); with it, ``indexer_logits`` then ``topk`` (the scores are
    kept). Both give the same logits (the reference composes the same two ops)."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp8"},
                      backend={"preference": ["torch"]})
    model = load_model(str(tiny))
    prompt = _prompts(8, [70])[0]
    out, calls = [], []
    for capture in (False, True):
        with recording():
            session = PrefillSession(model, s, CPGroup.single())
        ops = session.ops
        seen: list[str] = []

        def spy(name: str, fn: Any, seen: list[str] = seen) -> Any:
            def call(*args: Any) -> Any:
                seen.append(name)
                return fn(*args)
            return call

        session.driver.ops = types.SimpleNamespace(**{
            **{k: getattr(ops, k) for k in ops.chosen},
            **{k: spy(k, getattr(ops, k)) for k in ("indexer_logits", "topk", "indexer_topk")}},
            has=ops.has)
        out.append(session.prefill([("a", prompt)], capture_topk=capture))
        calls.append(set(seen))
    assert calls == [{"indexer_topk"}, {"indexer_logits", "topk"}]
    assert torch.equal(out[0].last_logits, out[1].last_logits)


def test_token_ids_as_a_tensor_equal_a_list(tiny: Path) -> None:
    """A request's ids given as a 1-D tensor (what engines hold) prefill exactly like the same
    ids as a list, continuing a cached prefix too (the slice starts past the prefix)."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]})
    model = load_model(str(tiny))
    first, more = _prompts(8, [40, 30])
    out = []
    for wrap in (list, lambda ids: torch.tensor(ids, dtype=torch.int32)):
        with recording():
            session = PrefillSession(model, s, CPGroup.single())
        a = session.prefill([("a", wrap(first))])
        b = session.prefill([("a", wrap(more))])  # the same request continued
        out.append((a.last_logits, b.last_logits))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_rotations_go_through_the_op_tables_rope(tiny: Path) -> None:
    """The driver applies the rotary embedding with its op table's ``rope`` (four rotations a
    layer: MLA query and key, indexer query and key); a table without the op leaves the
    model's own reference sequence, with the same logits bit for bit."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]})
    model = load_model(str(tiny))
    prompt = _prompts(9, [50])[0]
    calls: list[str] = []
    out = []
    for keep in (True, False):
        with recording():
            session = PrefillSession(model, s, CPGroup.single())
        impls = session.ops._impls
        assert session.ops.chosen["rope"] == "torch"
        if keep:
            real = impls["rope"]
            impls["rope"] = lambda x, c, s_, style, o, real=real: (calls.append(style),
                                                                  real(x, c, s_, style, o))[1]
        else:
            del impls["rope"]
        out.append(session.prefill([("a", prompt)]).last_logits)
    # the indexer's pair: DeepSeek-V3.2 half-split, GLM-5 interleaved; none on a shared layer
    style = "interleave" if model.config.model_type == "glm_moe_dsa" else "half"
    assert calls == [r for ix in model.index_layers
                     for r in ["interleave", "interleave", *([style, style] if ix else [])]]
    assert len(calls) == 4 * model.kv_layers - 2 * model.index_layers.count(False)
    assert torch.equal(out[0], out[1])


def test_fp8_indexer_queries_on_an_fp8_pool(tiny: Path) -> None:
    """``runtime.indexer_dtype = "fp8"`` on an fp8 pool: the indexer gets fp8 queries with their
    scales folded into the head weights, and the prefill equals one whose indexer gets the same
    quantized queries dequantized to fp32 with the original weights (relu(s x) = s relu(x));
    on a bf16 pool the setting changes nothing (the keys are not fp8)."""
    from cpkv.models import load_model
    from cpkv.ops import quantize_index_q
    from cpkv.runtime.session import PrefillSession

    model = load_model(str(tiny))
    prompt = _prompts(7, [70])[0]
    seen: list[torch.dtype] = []

    def dequantized(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q8, _ = quantize_index_q(q, w)
        # the indexer's ue8m0 scale: the power of two at or above amax / 448
        s = torch.pow(2.0, torch.ceil(torch.log2(q.float().abs().amax(dim=-1).clamp_min(1e-4)
                                                 / 448.0)))
        return q8.float() * s[..., None], w

    def run(pool: str, q_dtype: str, swap: bool = False) -> torch.Tensor:
        s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": pool},
                          backend={"preference": ["torch"]}, runtime={"indexer_dtype": q_dtype})
        with recording():
            session = PrefillSession(model, s, CPGroup.single())
        plain = session.ops.indexer_logits

        def spy(q: torch.Tensor, w: torch.Tensor, *rest: object) -> torch.Tensor:
            seen.append(q.dtype)
            if swap:
                q, w = dequantized(q, w)
            return plain(q, w, *rest)

        session.driver.ops = types.SimpleNamespace(**{
            **{k: getattr(session.ops, k) for k in session.ops.chosen}, "indexer_logits": spy},
            has=session.ops.has)
        return session.prefill([("a", prompt)], capture_topk=True)

    fp8_q = run("fp8", "fp8")
    assert set(seen) == {torch.float8_e4m3fn}
    seen.clear()
    same = run("fp8", "bf16", swap=True)
    assert torch.float8_e4m3fn not in seen
    rel = ((fp8_q.last_logits - same.last_logits).abs().amax()
           / same.last_logits.abs().amax()).item()
    assert rel < 1e-4, rel
    seen.clear()
    assert torch.equal(run("bf16", "fp8").last_logits, run("bf16", "bf16").last_logits)
    assert torch.float8_e4m3fn not in seen


def test_row_chunks_respect_the_budget() -> None:
    from cpkv.runtime.prefill import row_chunks

    chunks = row_chunks(1000, 4 * 300, budget_bytes=300 * 4 * 64)
    assert chunks[0] == (0, 64) and chunks[-1][1] == 1000
    assert all(e - s <= 64 for s, e in chunks) and row_chunks(0, 10, 1) == []


def _index_keys_made_and_written(model: Any, settings: Any, prompt: tuple[int, ...]
                                 ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The index keys the model made and those the driver wrote into the pool, per layer (None
    on a shared-indexer layer)."""
    from cpkv.runtime.session import PrefillSession

    with recording():
        session = PrefillSession(model, settings, CPGroup.single())
    made: list[torch.Tensor | None] = []
    written: list[torch.Tensor | None] = []
    plain_inputs, plain_write = model.attention_inputs, session.pool.write

    def inputs(*a: Any, **k: Any) -> Any:
        out = plain_inputs(*a, **k)
        made.append(None if out.index_k is None else out.index_k.clone())
        return out

    def write(layer: int, kv: Any, latent: torch.Tensor, index_k: torch.Tensor | None) -> None:
        written.append(None if index_k is None else index_k.clone())
        plain_write(layer, kv, latent, index_k)

    model.attention_inputs = inputs
    session.pool.write = write  # type: ignore[method-assign]
    try:
        session.prefill([("a", prompt)])
    finally:
        del model.attention_inputs
    return made, written


def test_fp8_pool_holds_rotated_index_keys(tiny: Path) -> None:
    """An fp8 pool's index-K is DeepSeek's: the model's index keys rotated
    (``hadamard_rotate``) before the ue8m0 pack; a bf16 pool gets the keys as the model made
    them."""
    from cpkv.models import load_model
    from cpkv.ops import hadamard_rotate

    model = load_model(str(tiny))
    prompt = _prompts(11, [40])[0]
    for dtype, rotated in (("fp8", True), ("bf16", False)):
        s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": dtype},
                          backend={"preference": ["torch"]},
                          runtime={"indexer_dtype": "fp8" if dtype == "fp8" else "bf16"})
        made, written = _index_keys_made_and_written(model, s, prompt)
        assert len(made) == len(written) == model.kv_layers
        for a, b, ix in zip(made, written, model.index_layers, strict=True):
            if not ix:  # a shared-indexer layer makes and stores no index-K
                assert a is None and b is None
                continue
            assert torch.equal(b, hadamard_rotate(a) if rotated else a)
            if rotated:
                assert not torch.allclose(b, a)
