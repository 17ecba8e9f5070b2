"""cpkv's DeepSeek-V4 one-rank forward against transformers' ``DeepseekV4ForCausalLM`` on tiny
random checkpoints (fp32): mixes of sliding / CSA / HCA layers, MoE and hash-MoE, yarn and
default compress rope, prompt lengths that are multiples of no rate; the compressor's carry
(``prior``) equals compressing in one piece; the stable top-k's tie-break."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.models.deepseek_v4 import DeepseekV4, stable_topk
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_config import CSA, HCA, SWA
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import v4_op_table

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "tiny": {},
    "hca-first": dict(layer_types=[HCA, CSA, SWA], mlp_layer_types=["moe", "hash_moe", "moe"],
                      num_hidden_layers=3, compress_rates={CSA: 4, HCA: 8}, sliding_window=5,
                      index_topk=2, scoring_func="sigmoid", hc_mult=2,
                      rope_parameters={"rope_type": "default"}),
    "csa-8": dict(layer_types=[CSA, CSA], mlp_layer_types=["moe", "moe"], num_hidden_layers=2,
                  compress_rates={CSA: 8, HCA: 16}, sliding_window=3, index_topk=3),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4")
    return {name: write_tiny_checkpoint(root / name, seed=7, model_type="deepseek_v4", **over)
            for name, over in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("length", [37, 53])
def test_logits_equal_transformers(checkpoints: dict[str, Path], name: str, length: int) -> None:
    path = checkpoints[name]
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path).eval()
    ours = DeepseekV4.load(path, ops=v4_op_table())
    ids = torch.randint(0, ours.config.vocab_size, (length,),
                        generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = hf(ids[None], use_cache=False).logits[0]
        got = reference_forward(ours, ids)
    last_ref, last = ref[-1], got[-1]
    assert (last - last_ref).abs().max() <= 2e-3 * last_ref.abs().max()
    assert int(last.argmax()) == int(last_ref.argmax())
    assert (got - ref).abs().max() <= 2e-3 * ref.abs().max()  # every row, not only the last


def test_compress_in_pieces_equals_one_piece(checkpoints: dict[str, Path]) -> None:
    """Entries of windows [a, b) from their rows plus the previous window's rows (CSA's Ca
    halo) are bit-equal to the same entries compressed in one piece."""
    model = DeepseekV4.load(checkpoints["tiny"], ops=v4_op_table())
    h = torch.randn(48, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in range(model.num_layers):
        for comp in model.compressors(layer):
            if comp is None:
                continue
            kv, gate = model.compressor_inputs(comp, h)
            m = comp.rate
            whole = model.compress(comp, kv, gate, 0)
            for a in range(1, whole.shape[0]):
                prior = (kv[(a - 1) * m: a * m], gate[(a - 1) * m: a * m]) if comp.overlap else None
                part = model.compress(comp, kv[a * m:], gate[a * m:], a, prior)
                assert torch.equal(part, whole[a:]), (layer, a)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 12), st.integers(0, 3))
def test_stable_topk(rows: int, entries: int, k: int, levels: int) -> None:
    """Score descending, index ascending among equal scores; -inf never picked; -1 padded."""
    gen = torch.Generator().manual_seed(rows * 100 + entries * 10 + k)
    scores = torch.randint(0, levels + 1, (rows, entries), generator=gen).float()
    scores[torch.rand(rows, entries, generator=gen) < 0.3] = float("-inf")
    got = stable_topk(scores, k)
    assert got.shape == (rows, k)
    for r in range(rows):
        want = sorted((j for j in range(entries) if scores[r, j] > float("-inf")),
                      key=lambda j: (-scores[r, j].item(), j))[:k]
        assert got[r].tolist() == want + [-1] * (k - len(want))
