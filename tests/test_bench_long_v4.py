"""``cpkv bench long --preset v4-*`` on the CPU at tiny sizes: the rank function prefills in
chunks on the op table it was given, times every ``v4_*`` op group and ends on the one-rank
forward's last token; the rows' names, units and baselines; the FLOP count grows as the
indexer's quadratic term says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpkv.bench.long_v4 import V4LongSpec, op_groups, stack_flops_v4, v4_long_rank, v4_long_rows
from cpkv.comm import CPGroup
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import v4_op_table


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v4long") / "tiny", seed=2,
                                 model_type="deepseek_v4")


def test_rank_times_each_op_group_and_matches_the_forward(tiny_v4: Path) -> None:
    spec = V4LongSpec(str(tiny_v4), (150,), 64, preference=("torch",))  # unit 64: 3 chunks
    res = v4_long_rank(CPGroup.single(), spec)
    run = res["runs"]["150"]
    assert set(run["groups"]) == set(op_groups()) and all(v > 0 for v in run["groups"].values())
    assert sum(run["groups"].values()) < run["seconds"]
    assert res["chosen"] == {k: "torch" for k in res["chosen"]}
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(150))
    with torch.no_grad():
        assert run["last_argmax"] == int(reference_forward(model, ids)[-1].argmax())
    rows = v4_long_rows(res, {"fp8_matmul_sustained_tflops": 1000.0}, 80.0,
                        "v4-flash-attention")
    names = {r.name: r for r in rows}
    assert names["v4flash_long_150_mfu"].baseline_name == "fp8_matmul_sustained_tflops"
    assert names["v4flash_long_150_indexer_seconds"].ratio < 1
    kv = names["v4flash_kv_bytes_per_token"]
    assert kv.value == pytest.approx(3850.25) and kv.baseline_value == 61 * 788


def test_flops_grow_with_the_indexer_s_quadratic_term(tiny_v4: Path) -> None:
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    small, big = stack_flops_v4(model, 4096), stack_flops_v4(model, 8192)
    assert 2 < big / small < 4  # linear projections and a quadratic indexer / HCA part
