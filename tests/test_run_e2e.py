"""`cpkv run`, the main job, end to end against transformers' own forward pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import hf_logits, hf_random_model  # noqa: E402


def _cpkv(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpkv.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env}, check=False)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("mode", "materialize"), [("zigzag", "all_gather"), ("interleave", "p2p")])
def test_cpkv_run_matches_transformers(tmp_path: Path, mode: str, materialize: str) -> None:
    # 16 indexer heads: with few heads many logits are exactly 0 and top-k ties become likely
    hf = hf_random_model(tmp_path / "ckpt", seed=1, index_n_heads=16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (70, 41, 9)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    report, logits = tmp_path / "report.json", tmp_path / "logits.pt"
    out = _cpkv("run", "--model", str(tmp_path / "ckpt"), "--cp", "2", "--mode", mode,
                "--prompts", str(tmp_path / "prompts.json"), "--report", str(report),
                "--save-logits", str(logits),
                env={"CPKV_KV__DTYPE": "fp32", "CPKV_KV__PAGE_SIZE": "8",
                     "CPKV_KV__MATERIALIZE": materialize})
    assert out.returncode == 0, out.stdout + out.stderr
    got = torch.load(logits)
    assert got.dtype == torch.float32 and got.shape == (3, 512)
    for i, p in enumerate(prompts):
        want = hf_logits(hf, torch.tensor(p))[-1]
        rel = float((got[i] - want).abs().max() / want.abs().max())
        assert rel < 1e-4, f"prompt {i}: cpkv run vs transformers {rel:.2e}"
    rep = json.loads(report.read_text())
    assert rep["cp"] == 2 and rep["mode"] == mode and rep["correct"] is True
    assert rep["materialize"] == materialize  # p2p: shared memory between the Gloo ranks
    assert rep["max_rel_err_vs_reference"] <= 1e-4
    assert sum(rep["kv_bytes_per_rank"]) == rep["kv_bytes_replicated"]
    assert all({"rank", "op", "reason"} <= set(f) for f in rep["fallbacks"])
    # the default backend order passes over what cannot run here quietly (no fallback for it)
    assert not any(f["reason"] == "plugin_unavailable" for f in rep["fallbacks"])
    assert rep["backends"]["chosen"]["sparse_mla"] in ("cuda", "triton", "torch")
    # transfer and decode phases (default: the nccl plugin over Gloo, 8 greedy tokens)
    tr = rep["transfer"]
    assert tr["plugin"] == "nccl" and tr["bytes_per_rank"] == rep["kv_bytes_per_rank"]
    assert tr["entries"] >= 1 and tr["seconds"] >= 0
    # the default pipeline sends after each prefill: nothing overlaps it, ready after it
    assert tr["pipeline"] == "request" and tr["overlap_seconds"] == 0
    assert tr["ready_seconds"] > 0 and len(tr["ready_seconds_per_request"]) >= 3
    assert rep["decode"]["tokens_match_reference"] is True
    assert [len(t) for t in rep["decode"]["tokens"]] == [8, 8, 8]


@pytest.mark.multiprocess
def test_run_rejects_bad_prompts(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps([[1, 2, 99999]]))
    out = _cpkv("run", "--prompts", str(bad), env={})
    assert out.returncode == 1 and "outside the vocabulary" in out.stderr
    out = _cpkv("run", "--model", str(tmp_path / "nope"), env={})
    assert out.returncode == 1 and "--model (run.model) = " in out.stderr
    assert "no such directory" in out.stderr and "cpkv init-model" in out.stderr


def test_job_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' takes GPUs only when there is one per process; 'cuda' puts process r on GPU r
    under NCCL when there are enough; with one GPU fewer the decode rank shares GPU 0 in a Gloo
    world, refused for the nccl transfer with the fix; fewer GPUs than prefill ranks is an error
    that says how many were needed and found."""
    import torch

    from cpkv.runtime.job import job_placement

    for gpus in (0, 1, 2, 3, 8):
        monkeypatch.setattr(torch.cuda, "is_available", lambda g=gpus: g > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda g=gpus: g)
        auto = job_placement("auto", 2, True, "mooncake")
        assert (auto.device, auto.backend) == (("cuda", "nccl") if gpus >= 3 else ("cpu", "gloo"))
        cpu = job_placement("cpu", 2, True)
        assert (cpu.device, cpu.backend, cpu.gpus, cpu.shared) == ("cpu", "gloo", None, False)
        if gpus >= 3:
            p = job_placement("cuda", 2, True)
            assert (p.backend, p.gpus, p.shared) == ("nccl", (0, 1, 2), False)
        elif gpus == 2:
            p = job_placement("cuda", 2, True, "mooncake")
            assert (p.device, p.backend, p.gpus, p.shared) == ("cuda", "gloo", (0, 1, 0), True)
            with pytest.raises(ValueError, match=r"share GPU 0.*transfer\.name = 'mooncake'"):
                job_placement("cuda", 2, True, "nccl")
            p = job_placement("cuda", 2, False)  # no decode rank: a GPU per prefill rank
            assert (p.backend, p.gpus) == ("nccl", (0, 1))
        else:
            with pytest.raises(ValueError, match=f"3 processes .*{gpus} GPU"):
                job_placement("cuda", 2, True, "mooncake")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one = job_placement("cuda", 1, True, "mooncake")  # one H200: CP1 and the decode rank on GPU 0
    assert (one.backend, one.gpus, one.shared) == ("gloo", (0, 0), True)
    with pytest.raises(ValueError) as err:  # prefill only: the fix is fewer CP ranks, not
        job_placement("cuda", 2, False)     # --decode-tokens 0 (already so)
    assert "--cp 1 or fewer" in str(err.value) and "--decode-tokens" not in str(err.value)


def test_compare_topk_counts_only_real_differences() -> None:
    """A swap at the k-th place within the tie tolerance of the row's score scale is not a
    difference; a swap of a key scored well above the k-th is."""
    import torch

    from cpkv.runtime.job import compare_topk

    ia = [torch.tensor([[0, 1, 2]], dtype=torch.int32)]
    sa = [torch.tensor([[50.0, 20.0, 3.0]])]
    near = [torch.tensor([[0, 1, 7]], dtype=torch.int32)], [torch.tensor([[50.0, 20.0, 3.3]])]
    far = [torch.tensor([[0, 9, 2]], dtype=torch.int32)], [torch.tensor([[50.0, 21.0, 3.0]])]
    assert compare_topk(ia, sa, ia, sa) == 0
    assert compare_topk(ia, sa, *near, rel_tie=1e-2) == 0  # 0.3 apart, scale 50: 0.5 tolerance
    assert compare_topk(ia, sa, *near, rel_tie=1e-6) == 1
    assert compare_topk(ia, sa, *far, rel_tie=1e-2) == 1  # 20 and 21 are far above the floor


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode"), [(2, "zigzag"), (4, "interleave")])
def test_cpkv_run_on_a_glm5_checkpoint_matches_transformers(tmp_path: Path, cp: int,
                                                            mode: str) -> None:
    """A GLM-5 checkpoint written by transformers (full, shared, shared, full): last-token logits
    within 2e-3 relative of GlmMoeDsaForCausalLM's with argmax equal, and each rank holds at most
    1/C + one page per request of a replica whose index-K counts the full layers only."""
    from cpkv.contracts import KVFormat

    hf = hf_random_model(tmp_path / "ckpt", seed=1, arch="glm5", index_n_heads=16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (70, 41, 9)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    report, logits = tmp_path / "report.json", tmp_path / "logits.pt"
    out = _cpkv("run", "--model", str(tmp_path / "ckpt"), "--cp", str(cp), "--mode", mode,
                "--prompts", str(tmp_path / "prompts.json"), "--report", str(report),
                "--save-logits", str(logits),
                env={"CPKV_KV__DTYPE": "fp32", "CPKV_KV__PAGE_SIZE": "8"})
    assert out.returncode == 0, out.stdout + out.stderr
    got = torch.load(logits)
    for i, p in enumerate(prompts):
        want = hf_logits(hf, torch.tensor(p))[-1]
        rel = float((got[i] - want).abs().max() / want.abs().max())
        assert rel < 2e-3, f"prompt {i}: cpkv run vs transformers {rel:.2e}"
        assert int(got[i].argmax()) == int(want.argmax())
    rep = json.loads(report.read_text())
    assert rep["correct"] is True and rep["cp"] == cp
    full = KVFormat(dtype="fp32", page_size=8, kv_lora_rank=32, rope_dim=8, index_head_dim=16,
                    quant_block=32)
    page = 2 * full.page_bytes + 2 * full.latent_page_bytes  # 4 layers, 2 of them latent-only
    pages = sum(-(-len(p) // 8) for p in prompts)
    assert rep["kv_bytes_replicated"] == pages * page  # index-K of the full layers only
    assert sum(rep["kv_bytes_per_rank"]) == rep["kv_bytes_replicated"]
    for held in rep["kv_bytes_per_rank"]:
        assert held <= rep["kv_bytes_replicated"] / cp + len(prompts) * page
    assert rep["decode"]["tokens_match_reference"] is True
