"""GPU-only checks of the runtime (CI has no GPU: these skip with a reason there)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.fallback import recording
from cpkv.runtime import run_ranks
from cpkv.settings import load_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,  # every test spawns its ranks with run_ranks
]


def _prompts(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def _layers_under_sync_debug(group: CPGroup, model_dir: str,
                             materialize: str = "all_gather") -> tuple[str, list[float]]:
    """CP prefill whose layer loop runs with set_sync_debug_mode("error") (rule 22)."""
    from cpkv.models import load_model
    from cpkv.runtime.prefill import CPPrefill
    from cpkv.runtime.session import PrefillSession

    real = CPPrefill._layers

    def guarded(self, *a, **k):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(self, *a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    CPPrefill._layers = guarded  # type: ignore[method-assign]
    s = load_settings(cp={"size": group.size},
                      kv={"dtype": "fp8", "page_size": 64, "materialize": materialize},
                      backend={"preference": ["triton", "torch"]})
    session = PrefillSession(load_model(model_dir, device=group.device), s, group)
    session.prefill([("a", _prompts(700)), ("b", _prompts(300, 1))])
    out = session.prefill([("a", _prompts(200, 2))])  # prefix of 700: mid-page, prefetch path
    return session.pool.store.views.mode, out.last_logits[0, :4].float().cpu().tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cpkv.models import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3)


@pytest.mark.parametrize("materialize", ["all_gather", "p2p"])
def test_layer_loop_has_no_host_sync_on_gpu(tiny: Path, materialize: str) -> None:
    size = 2 if torch.cuda.device_count() >= 2 else 1
    res = run_ranks(_layers_under_sync_debug, size, args=(str(tiny), materialize),
                    backend="nccl", timeout_s=300)
    assert all(r.value[0] == materialize and len(r.value[1]) == 4 for r in res)


def _cp_logits(group: CPGroup, model_dir: str, materialize: str = "all_gather") -> torch.Tensor:
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    s = load_settings(cp={"size": group.size},
                      kv={"dtype": "fp32", "page_size": 16, "materialize": materialize},
                      backend={"preference": ["triton", "torch"]})
    session = PrefillSession(load_model(model_dir, device=group.device), s, group)
    session.prefill([("a", _prompts(333)), ("b", _prompts(90, 1))])
    return session.prefill([("a", _prompts(120, 2))]).last_logits.float().cpu()


@pytest.mark.gpu(2)
@pytest.mark.parametrize("materialize", ["all_gather", "p2p"])
def test_nccl_cp2_equals_one_rank(tiny: Path, materialize: str) -> None:
    two = run_ranks(_cp_logits, 2, args=(str(tiny), materialize), backend="nccl", timeout_s=300)
    assert not any(e.reason.value == "peer_memory_unavailable" for r in two for e in r.fallbacks)
    with recording():
        one = _cp_logits(CPGroup.single(device="cuda:0"), str(tiny))
    rel = float((two[0].value - one).abs().max() / one.abs().max())
    assert rel < 1e-4, rel


@pytest.mark.gpu(2)
def test_p2p_pool_views_equal_replica_on_two_gpus() -> None:
    """Symmetric memory over NVLink: every view read from the owners' buffers equals the
    replicated pool's and the truth, bit for bit, for bf16 and fp8 pools and both modes."""
    from cpkv.contracts import KVDtype, KVFormat, SplitMode
    from cpkv.testing.pool_check import PoolScenario, random_batches, run_pool_scenarios

    rng = random.Random(7)
    scs = [PoolScenario(batches=random_batches(rng, max_extend=300), mode=mode,
                        fmt=KVFormat.deepseek_v32(dtype), preference=("triton", "torch"),
                        materialize="p2p", seed=rng.randrange(1 << 30))
           for mode in SplitMode for dtype in (KVDtype.BF16, KVDtype.FP8)]
    res = run_ranks(run_pool_scenarios, 2, args=(scs,), backend="nccl", timeout_s=300)
    for r in res:
        for o in r.value:
            assert o.materialize_mode == "p2p" and o.mismatches == [], o.mismatches
