"""DeepSeek-V4 decode on one rank (:mod:`cpkv.runtime.v4_decode`): the prefill through the decode
step's code equals the one-rank reference bit for bit; greedy decode from its state equals the
reference recomputed on the grown sequence (and transformers' greedy generation), with entries
completing during the decode at every rate; a state grown token by token matches one grown in a
single piece; the state's counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cpkv.kv.v4_state import V4DecodeState
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_config import CSA, HCA, SWA
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import v4_op_table
from cpkv.runtime.v4_decode import v4_empty_state, v4_extend, v4_greedy

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {},  # SWA, CSA (rate 4), HCA (rate 16), CSA; window 8; top-4
    "hca-8": dict(layer_types=[HCA, CSA, SWA], mlp_layer_types=["moe", "hash_moe", "moe"],
                  num_hidden_layers=3, compress_rates={CSA: 4, HCA: 8}, sliding_window=5,
                  index_topk=2, scoring_func="sigmoid", hc_mult=2,
                  rope_parameters={"rope_type": "default"}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4dec")
    return {name: write_tiny_checkpoint(root / name, seed=7, model_type="deepseek_v4", **over)
            for name, over in CONFIGS.items()}


def _ids(length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def _prefill(model: DeepseekV4, ids: torch.Tensor) -> tuple[V4DecodeState, torch.Tensor]:
    state = v4_empty_state(model)
    return state, v4_extend(model, state, ids)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("length", "steps"), [(37, 20), (3, 18)])
def test_greedy_equals_reference_on_grown_sequence(checkpoints: dict[str, Path], name: str,
                                                   length: int, steps: int) -> None:
    """The reference is causal, so its logits over prompt + decoded tokens at row ``t`` are the
    reference recomputed on the first ``t + 1`` tokens: every step's argmax must be the next
    decoded token."""
    model = DeepseekV4.load(checkpoints[name], ops=v4_op_table())
    ids = _ids(length)
    with torch.no_grad():
        state, logits = _prefill(model, ids)
        assert torch.equal(logits, reference_forward(model, ids))
        tokens = v4_greedy(model, state, int(logits[-1].argmax()), steps)
        grown = torch.cat([ids, torch.tensor(tokens)])
        ref = reference_forward(model, grown)
    assert state.length == length + steps - 1
    state.check()
    rates = {c.carry.rate for layer in state.layers for c in layer.compressors.values()}
    for m in rates:  # entries completed during the decode at every rate
        assert length // m < state.length // m
    assert ref[length - 1:-1].argmax(-1).tolist() == tokens


def test_state_grown_token_by_token_matches_one_piece(checkpoints: dict[str, Path]) -> None:
    model = DeepseekV4.load(checkpoints["tiny"], ops=v4_op_table())
    ids = _ids(41)
    with torch.no_grad():
        whole, _ = _prefill(model, ids)
        steps, _ = _prefill(model, ids[:19])
        for t in ids[19:]:
            v4_extend(model, steps, t[None])
    assert steps.length == whole.length == 41
    for a, b in zip(steps.layers, whole.layers, strict=True):
        torch.testing.assert_close(a.window, b.window, rtol=1e-4, atol=1e-5)
        for n, ca in a.compressors.items():
            cb = b.compressors[n]
            assert ca.carry.entries == cb.carry.entries == ca.entries.shape[0]
            torch.testing.assert_close(ca.entries, cb.entries, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ca.carry.open_kv, cb.carry.open_kv, rtol=1e-4, atol=1e-5)
            assert (ca.carry.prior_kv is None) == (cb.carry.prior_kv is None)


def test_check_names_a_wrong_count(checkpoints: dict[str, Path]) -> None:
    model = DeepseekV4.load(checkpoints["tiny"], ops=v4_op_table())
    with torch.no_grad():
        state, _ = _prefill(model, _ids(21))
    state.check()
    state.length = 22  # an open row missing
    with pytest.raises(ValueError, match="rate 4"):
        state.check()


@pytest.mark.slow
def test_greedy_equals_transformers_generate(checkpoints: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    model = DeepseekV4.load(checkpoints["tiny"], ops=v4_op_table())
    ids = _ids(37)
    with torch.no_grad():
        state, logits = _prefill(model, ids)
        tokens = v4_greedy(model, state, int(logits[-1].argmax()), 24)
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoints["tiny"]).eval()
        out = hf.generate(ids[None], max_new_tokens=24, do_sample=False, use_cache=True)
    assert out[0, 37:].tolist() == tokens
