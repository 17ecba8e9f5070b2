"""``cpkv bench long``'s parts on the CPU: the chunked prefills of one rank (logits equal across
chunkings, one timing per chunk), the rows built from them, and the top-k recall measure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpkv.bench.long import LongSpec, _recall, long_rank, long_rows, topk_share
from cpkv.models import write_tiny_checkpoint
from cpkv.runtime import run_ranks


def test_recall_counts_shared_columns_of_full_rows() -> None:
    a = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, -1, -1]], dtype=torch.int32)
    b = torch.tensor([[3, 2, 1, 0], [4, 5, 8, 9], [5, 6, -1, -1]], dtype=torch.int32)
    mean, low, rows = _recall(a, b, 4)
    assert (mean, low, rows) == (0.75, 0.5, 2)  # the short third row is left out
    assert _recall(a[2:], b[2:], 4) == (1.0, 1.0, 0)


def test_topk_share_sums_the_kernels_by_name() -> None:
    kern = [{"kernel": "_topk_filter_kernel", "ms": 2.0}, {"kernel": "_topk_select_kernel", "ms": 1.0},
            {"kernel": "_indexer_kernel", "ms": 10.0}, {"kernel": "gemm", "ms": 50.0}]
    assert topk_share(kern) == {"topk_ms": 3.0, "indexer_ms": 10.0}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_long_rank_chunkings_give_equal_logits(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=5)
    spec = LongSpec(str(ckpt), tokens=(200, 320), chunks=(64, 128, 320), profile=(320, 64))
    res = run_ranks(long_rank, 1, args=(spec,), timeout_s=300)[0].value
    assert res["logits_equal"] == {200: True, 320: True}
    assert [len(r["chunk_seconds"]) for r in res["runs"].values()] == [4, 2, 1, 5, 3, 1]
    rows = {r.name: r for r in long_rows(res, 100.0, 80.0)}
    assert set(rows) == {"long_200_mfu", "long_200_c128_mfu", "long_200_c320_mfu", "long_320_mfu",
                         "long_320_c128_mfu", "long_320_c320_mfu", "long_320_peak_gb"}
    assert rows["long_320_mfu"].ratio == pytest.approx(res["runs"]["320/64"]["layer_tflops"] / 100)
    r = res["runs"]["320/64"]
    assert r["layer_tflops"] * r["seconds"] > 0
