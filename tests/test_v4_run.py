"""``cpkv run --model DIR`` on a DeepSeek-V4 checkpoint: the last-token logits it saves equal
transformers' ``DeepseekV4ForCausalLM`` within 2e-3 relative (argmax equal) at CP2 zigzag and
CP4 interleave, with and without ``--chunk``, on prompts whose lengths are multiples of no rate;
the report's per-rank KV bytes sum to the entries once plus the tail objects; V4 and V3.2
bytes per token side by side; a chunk off the ownership unit is refused. With
``--decode-tokens N`` (CP2 and CP4, both transfer plugins) the decode rank's greedy tokens equal
the one-rank forward's and transformers' greedy generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cpkv.cli import main

transformers = pytest.importorskip("transformers")

LENGTHS = (53, 77)
ENV = {"CPKV_KV__PAGE_SIZE": "4"}  # ownership unit lcm(4, 4, 16) = 16 tokens


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("v4run")
    res = CliRunner().invoke(main, ["init-model", str(root / "ckpt"), "--arch", "v4",
                                    "--seed", "5", "--mtp"])
    assert res.exit_code == 0, res.output
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    (root / "prompts.json").write_text(json.dumps(prompts))
    return root / "ckpt", root / "prompts.json"


def _assert_like_transformers(ckpt: Path, prompts: Path, got: torch.Tensor) -> None:
    """Saved last-position logits within 2e-3 relative of transformers', argmax equal."""
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        for i, p in enumerate(json.loads(prompts.read_text())):
            ref = hf(torch.tensor([p]), use_cache=False).logits[0, -1]
            assert (got[i] - ref).abs().max() <= 2e-3 * ref.abs().max()
            assert int(got[i].argmax()) == int(ref.argmax())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "chunk"), [(2, "zigzag", None), (2, "zigzag", 32),
                                                   (4, "interleave", None),
                                                   (4, "interleave", 16)])
def test_run_equals_transformers(v4_dir: tuple[Path, Path], tmp_path: Path, cp: int, mode: str,
                                 chunk: int | None) -> None:
    ckpt, prompts = v4_dir
    out, rep = tmp_path / "logits.pt", tmp_path / "report.json"
    args = ["run", "--model", str(ckpt), "--cp", str(cp), "--mode", mode, "--prompts",
            str(prompts), "--save-logits", str(out), "--report", str(rep), "--decode-tokens", "0"]
    if chunk:
        args += ["--chunk", str(chunk)]
    res = CliRunner().invoke(main, args, env=ENV)
    assert res.exit_code == 0, res.output
    assert "DeepSeek-V3.2 (61 layers)" in res.output and "DeepSeek-V4-Flash" in res.output
    _assert_like_transformers(ckpt, prompts, torch.load(out))
    body = json.loads(rep.read_text())
    assert body["correct"] and body["family"] == "DeepSeek-V4"
    assert sum(body["kv_bytes_per_rank"]) == body["kv_bytes_entries"] + body["kv_bytes_tail"]


def test_chunk_off_the_unit_is_refused(v4_dir: tuple[Path, Path]) -> None:
    ckpt, prompts = v4_dir
    res = CliRunner().invoke(main, ["run", "--model", str(ckpt), "--cp", "2", "--prompts",
                                    str(prompts), "--chunk", "8"], env=ENV)
    assert res.exit_code != 0
    assert "ownership units of 16" in res.output


def test_mtp_of_a_v4_checkpoint_without_one_is_refused(v4_dir: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    _, prompts = v4_dir
    res = CliRunner().invoke(main, ["init-model", str(tmp_path / "plain"), "--arch", "v4"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["run", "--model", str(tmp_path / "plain"), "--prompts",
                                    str(prompts), "--mtp"], env=ENV)
    assert res.exit_code != 0 and "num_nextn_predict_layers = 0" in res.output, res.output


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "plugin", "chunk", "drafts"), [
    (2, "zigzag", "nccl", None, 0), (4, "interleave", "nccl", 16, 0),
    (2, "zigzag", "mooncake", None, 0), (4, "interleave", "nccl", 16, 2),
    (2, "zigzag", "mooncake", None, 1)])
def test_run_decodes_the_reference_tokens(v4_dir: tuple[Path, Path], tmp_path: Path, cp: int,
                                          mode: str, plugin: str, chunk: int | None,
                                          drafts: int) -> None:
    """Greedy decode (``drafts`` 0), or speculative with the MTP layer (``drafts`` a step):
    the tokens equal the one-rank forward's greedy ones either way; with the MTP layer its
    CP last-position logits equal the one-rank MTP forward's."""
    ckpt, prompts = v4_dir
    env = dict(ENV, CPKV_TRANSFER__NAME=plugin)
    if plugin == "mooncake":
        from cpkv_transfer_mooncake.plugin import probe

        if not probe().available:
            pytest.skip(f"mooncake: {probe().reason}")
        env["CPKV_TRANSFER__MOONCAKE__STAGE"] = "host"
    rep = tmp_path / "report.json"
    n = 7
    args = ["run", "--model", str(ckpt), "--cp", str(cp), "--mode", mode, "--prompts",
            str(prompts), "--decode-tokens", str(n), "--report", str(rep)]
    if chunk:
        args += ["--chunk", str(chunk)]
    if drafts:
        args += ["--mtp", "--draft-tokens", str(drafts)]
    res = CliRunner().invoke(main, args, env=env)
    assert res.exit_code == 0, res.output
    assert "decode tokens equal" in res.output and plugin in res.output
    body = json.loads(rep.read_text())
    if drafts:
        assert "speculatively" in res.output and body["speculation"]["steps"] > 0
        assert len(body["draft_rel_diff"]) == len(LENGTHS)
        assert all(d <= 2e-3 for d in body["draft_rel_diff"])
    else:
        assert body["speculation"] is None and body["draft_rel_diff"] == []
    assert body["correct"] and body["decode_equal"] == [True] * len(LENGTHS)
    assert body["decode_tokens"] == body["reference_tokens"]
    assert all(len(t) == n for t in body["decode_tokens"])
    assert len(body["bytes_sent_per_rank"]) == cp and all(b > 0 for b in body["tail_bundle_bytes"])
    if cp == 2 and plugin == "nccl":  # and transformers' greedy generation with its cache
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt).eval()
        with torch.no_grad():
            for p, toks in zip(json.loads(prompts.read_text()), body["decode_tokens"],
                               strict=True):
                out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
                assert out[0, len(p):].tolist() == toks


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reference_off_and_an_unbuilt_kv_dtype_are_said(v4_dir: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    """``--reference off`` checks nothing and says so (``correct`` null, every prompt
    unchecked); ``kv.dtype = fp8`` is a reported fallback (V4's FP8 pools are not built), not a
    silent fp32 run; "sample" checks the prompts that fit ``run.reference_tokens``."""
    ckpt, prompts = v4_dir
    rep = tmp_path / "off.json"
    env = dict(ENV, CPKV_KV__DTYPE="fp8")
    res = CliRunner().invoke(main, ["run", "--model", str(ckpt), "--prompts", str(prompts),
                                    "--decode-tokens", "0", "--reference", "off", "--report",
                                    str(rep)], env=env)
    assert res.exit_code == 0, res.output
    assert "not checked against one rank (run.reference = off)" in res.output
    body = json.loads(rep.read_text())
    assert body["correct"] is None and body["checked"] == [False] * len(LENGTHS)
    assert body["rel_diff"] == [None] * len(LENGTHS)
    assert [(f["op"], f["reason"]) for f in body["fallbacks"]
            if f["op"] == "v4_kv_dtype"] == [("v4_kv_dtype", "kv_dtype_unavailable")]
    rep = tmp_path / "sample.json"
    res = CliRunner().invoke(main, ["run", "--model", str(ckpt), "--prompts", str(prompts),
                                    "--decode-tokens", "0", "--reference", "sample", "--report",
                                    str(rep)], env=dict(ENV, CPKV_RUN__REFERENCE_TOKENS="60"))
    assert res.exit_code == 0, res.output
    body = json.loads(rep.read_text())
    assert body["checked"] == [n <= 60 for n in LENGTHS] and body["correct"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without GPUs")
def test_cuda_without_gpus_names_the_fix(v4_dir: tuple[Path, Path]) -> None:
    ckpt, prompts = v4_dir
    res = CliRunner().invoke(main, ["run", "--model", str(ckpt), "--prompts", str(prompts),
                                    "--device", "cuda", "--cp", "2"], env=ENV)
    assert res.exit_code != 0 and "needs a GPU per process" in res.output, res.output


@pytest.mark.gpu(2)
@pytest.mark.multiprocess
def test_run_on_cuda_equals_transformers(v4_dir: tuple[Path, Path], tmp_path: Path) -> None:
    """``--device cuda``: NCCL ranks on two GPUs, the torch v4 ops; the saved logits equal
    transformers' (on the CPU) within 2e-3."""
    ckpt, prompts = v4_dir
    out = tmp_path / "logits.pt"
    res = CliRunner().invoke(main, ["run", "--model", str(ckpt), "--cp", "2", "--mode",
                                    "zigzag", "--prompts", str(prompts), "--device", "cuda",
                                    "--decode-tokens", "0", "--save-logits", str(out)], env=ENV)
    assert res.exit_code == 0, res.output
    _assert_like_transformers(ckpt, prompts, torch.load(out))
