"""GLM-5 on one GPU (issue 36): a prefill at GLM-5's attention shape (64 heads, qk_nope 192,
v 256, latent 512 + 64, indexer 32 x 128, top-2048; a full and a shared-indexer layer, hidden
and q_lora made smaller to keep the checkpoint small) with the default backends: FlashMLA's
sparse prefill takes the 64 heads (no fallback) and the logits equal the torch backend's on the
same model and numerics within bf16 rounding. Skips without CUDA."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.fallback import recording
from cpkv.settings import load_settings

pytestmark = [pytest.mark.gpu]


def test_glm5_attention_prefill_takes_flashmla_and_equals_the_torch_backend(
        tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from cpkv.bench.gpu import attention_stack
    from cpkv.models import load_model, write_tiny_checkpoint
    from cpkv.runtime.session import PrefillSession

    stack = attention_stack("glm5-attention", 2, hidden_size=1024, q_lora_rank=512)
    model = load_model(write_tiny_checkpoint(tmp_path / "glm5", seed=0, **stack),
                       dtype=torch.bfloat16, device="cuda")
    assert model.config.layer_indexers == ("full", "shared")
    rng = random.Random(0)
    ids = [rng.randrange(model.config.vocab_size) for _ in range(3000)]  # > top-2048: sparse
    group = CPGroup.single("cuda")
    got = {}
    for pref in (["cuda", "triton", "torch"], ["torch"]):
        s = load_settings(cp={"size": 1}, kv={"page_size": 64}, backend={"preference": pref})
        with recording() as rec:
            session = PrefillSession(model, s, group)
            logits = session.prefill([("a", ids)]).last_logits[0].float().cpu()
        got[pref[0]] = (logits, dict(session.ops.chosen), list(rec.events))
        del session
        torch.cuda.empty_cache()
    fast, chosen, events = got["cuda"]
    assert chosen["sparse_mla"] == "cuda", chosen  # FlashMLA takes GLM-5's 64 heads
    assert not [e for e in events if "sparse_mla" in e.op], events
    ref = got["torch"][0]
    rel = float((fast - ref).abs().max() / ref.abs().max())
    assert rel < 5e-2, f"default backends vs torch: {rel:.3g} of the largest logit"
