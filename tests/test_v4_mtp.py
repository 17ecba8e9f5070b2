"""DeepSeek-V4's MTP draft layer (sliding-only, DeepSeek's ``MTPBlock``): loading it (refused
where the checkpoint has none, the target unchanged by it); under CP prefill its logits equal
the one-rank MTP forward bit for bit (chunked too) and its window rows join the tail bundle;
cutting an extension back (:func:`v4_truncate`) leaves the state of the rows kept; speculative
decoding equals greedy decoding token for token, with random drafts (none accepted) and with
drafts from an oracle that is right two times in three (accepted ones, partial acceptance)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.kv.v4_state import assemble_v4_state
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.errors import ModelLoadError
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_reference import reference_draft, reference_forward
from cpkv.ops import v4_op_table
from cpkv.runtime.v4_decode import (
    v4_draft,
    v4_empty_state,
    v4_extend,
    v4_extend_streams,
    v4_greedy,
    v4_truncate,
)
from cpkv.runtime.v4_prefill import V4Carry, v4_prefill_logits
from cpkv.runtime.v4_speculative import v4_speculative
from cpkv.runtime.v4_state import owned_entries, tail_bundle
from helpers import ThreadRanks

PAGE = 4  # unit 16 tokens: windows and the 7-row halo cross ranks


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4mtp")
    return {name: write_tiny_checkpoint(root / name, seed=5, model_type="deepseek_v4",
                                        num_nextn_predict_layers=n)
            for name, n in (("mtp", 1), ("plain", 0))}


@pytest.fixture(scope="module")
def model(ckpts: dict[str, Path]) -> DeepseekV4:
    return DeepseekV4.load(ckpts["mtp"], ops=v4_op_table(), mtp=True)


def _ids(length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def _prefilled(model: DeepseekV4, ids: torch.Tensor):  # type: ignore[no-untyped-def]
    """One-rank prefill of target and MTP rows: (state, first token, first draft)."""
    state = v4_empty_state(model)
    x, _ = v4_extend_streams(model, state, ids)
    first = int(model.final_logits(x)[-1].argmax())
    drafts, _ = v4_draft(model, state, x, torch.cat([ids[1:], torch.tensor([first])]), 0)
    return state, first, int(drafts[-1].argmax())


def test_mtp_asked_of_a_checkpoint_without_one_is_refused(ckpts: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match="no MTP draft layer"):
        DeepseekV4.load(ckpts["plain"], ops=v4_op_table(), mtp=True)
    plain = DeepseekV4.load(ckpts["plain"], ops=v4_op_table())
    assert plain.mtp_layer is None and plain.kv_layers == plain.num_layers
    with pytest.raises(ValueError, match="without its MTP draft layer"):
        plain.draft_logits(torch.zeros(1, plain.config.hc_mult, plain.config.hidden_size))


def test_the_mtp_layer_leaves_the_target_as_it_is(ckpts: dict[str, Path],
                                                  model: DeepseekV4) -> None:
    """The same seed with and without the MTP layer written: the same target; loading an
    MTP-bearing checkpoint without it skips its weights."""
    ids = _ids(29)
    plain = DeepseekV4.load(ckpts["plain"], ops=v4_op_table())
    skipped = DeepseekV4.load(ckpts["mtp"], ops=v4_op_table())
    with torch.no_grad():
        want = reference_forward(plain, ids)
        assert torch.equal(reference_forward(skipped, ids), want)
        assert torch.equal(reference_forward(model, ids), want)
    assert model.mtp_layer == model.num_layers and model.kv_layers == model.num_layers + 1
    assert model.layer_kind(model.num_layers) == "sliding_attention"


@pytest.mark.parametrize(("length", "cp", "mode", "chunks"), [
    (51, 4, "interleave", None), (45, 2, "zigzag", None), (53, 3, "interleave", [16, 37]),
    (7, 2, "zigzag", None)])
def test_cp_drafts_equal_the_one_rank_mtp_forward(model: DeepseekV4, length: int, cp: int,
                                                  mode: str, chunks: list[int] | None) -> None:
    """Every row's draft logits (row i from the target's streams and token i + 1; after the
    prompt the target's argmax) equal the one-rank MTP forward bit for bit on every rank, and
    the tail bundle carries the MTP layer's window rows: the state assembled from the ranks'
    parts equals the one-rank prefill's."""
    ids = _ids(length)

    def rank(g: object) -> tuple[torch.Tensor, torch.Tensor, object, object]:
        carry = V4Carry()
        logits = v4_prefill_logits(model, ids, cast(CPGroup, g), page_size=PAGE, mode=mode,
                                   chunks=chunks, carry=carry)
        grp = cast(CPGroup, g)
        return (logits, torch.cat(carry.draft_logits), owned_entries(model, carry, grp.rank),
                tail_bundle(model, carry))

    with torch.no_grad():
        got = ThreadRanks(cp).run(rank)
        ref = reference_forward(model, ids)
        want = reference_draft(model, ids, torch.cat([ids[1:], ref[-1:].argmax(-1)]))
        one, _, _ = _prefilled(model, ids)
    for logits, drafts, _, _ in got:
        assert torch.equal(logits, ref)
        assert torch.equal(drafts, want)
    tails = [t for *_, t in got if t is not None]
    assert len(tails) == 1 and len(tails[0].layers) == model.kv_layers  # type: ignore[attr-defined]
    state = assemble_v4_state([o for _, _, o, _ in got], tails[0])  # type: ignore[misc,arg-type]
    mtp = model.num_layers
    torch.testing.assert_close(state.layers[mtp].window, one.layers[mtp].window,
                               rtol=1e-5, atol=1e-6)
    assert state.length == one.length == length


@pytest.mark.parametrize("start", [0, 13, 16, 31])
def test_truncate_keeps_the_state_of_the_rows_kept(model: DeepseekV4, start: int) -> None:
    """Extend by 20 rows and cut back to k: the window rings, open and prior windows and
    entries of a state extended by those k rows (the same counts and shapes; the values
    within float noise: a row's bits depend on the rows computed with it), and 0 rows back
    is the state before, bit for bit."""
    ids = _ids(start + 20, seed=9)
    with torch.no_grad():
        for keep in (0, 1, 5, 13, 20):
            cut = v4_empty_state(model)
            v4_extend(model, cut, ids[:start])
            before = cut.fork()
            kept = cut.fork()
            v4_extend(model, kept, ids[start:start + keep])
            _, appended = v4_extend_streams(model, cut, ids[start:], keep=True)
            assert appended is not None
            v4_truncate(model, cut, appended, keep)
            cut.check()
            if keep == 0:
                assert cut.equal(before)
            assert cut.length == kept.length
            for a, b in zip(cut.layers, kept.layers, strict=True):
                torch.testing.assert_close(a.window, b.window, rtol=1e-4, atol=1e-5)
                for n, ca in a.compressors.items():
                    cb = b.compressors[n]
                    torch.testing.assert_close(ca.entries, cb.entries, rtol=1e-4, atol=1e-5)
                    torch.testing.assert_close(ca.carry.open_kv, cb.carry.open_kv,
                                               rtol=1e-4, atol=1e-5)
                    assert (ca.carry.prior_kv is None) == (cb.carry.prior_kv is None)
                    if ca.carry.prior_kv is not None:
                        torch.testing.assert_close(ca.carry.prior_kv, cb.carry.prior_kv,
                                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="keep 21 of 20"):
        v4_truncate(model, cut, appended, 21)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_equals_greedy_with_the_mtp_drafts(model: DeepseekV4, k: int) -> None:
    ids = _ids(37)
    with torch.no_grad():
        state, first, draft = _prefilled(model, ids)
        greedy = v4_greedy(model, state.fork(), first, 21)
        got, stats = v4_speculative(model, state, first, draft, 21, k)
    assert got == greedy
    assert stats.steps >= 1 and stats.accepted <= stats.drafted


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_greedy_when_drafts_are_accepted(model: DeepseekV4,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           k: int) -> None:
    """Drafts from an oracle that knows the greedy continuation and is wrong every third
    guess: drafts are accepted, in full and in part, and the tokens are still greedy's."""
    ids = _ids(40, seed=4)
    with torch.no_grad():
        state, first, _ = _prefilled(model, ids)
        greedy = v4_greedy(model, state.fork(), first, 30)
    truth = ids.tolist() + greedy + [0] * 8
    calls = [0]

    def oracle_draft(streams: torch.Tensor, next_ids: torch.Tensor, start: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        # row at position p guesses token p + 2 (of the greedy continuation)
        n = next_ids.shape[0]
        out = torch.zeros(n, model.config.vocab_size)
        for j in range(n):
            calls[0] += 1
            tok = truth[start + j + 2]
            out[j, (tok + 1) % model.config.vocab_size if calls[0] % 3 == 0 else tok] = 1.0
        return out, streams

    import cpkv.runtime.v4_speculative as spec

    monkeypatch.setattr(spec, "v4_draft", lambda m, s, x, nxt, start: oracle_draft(x, nxt, start))
    with torch.no_grad():
        got, stats = v4_speculative(model, state, first, truth[len(ids) + 1], 30, k)
    assert got == greedy
    assert 0 < stats.accepted < stats.drafted
