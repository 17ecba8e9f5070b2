"""Last-token logits of cpkv's KV / indexer numerics
against transformers' own fp32 forward pass, over several checkpoints (seeds) and prompts.

Numerics (cpkv prefill, one rank, the model in ``--dtype``): ``bf16`` pool + bf16 indexer,
``fp8_pool_bf16_indexer``, ``fp8_default`` (fp8 pool + fp8 indexer: the GPU default) and the
same three with ``index_topk`` raised past the prompt (``*_allkeys``: every key selected, so
the error left is the KV numerics', not the selection's).

CPU (default): random transformers checkpoints of a tiny DeepSeek-V3.2 shape with DeepSeek's
index head (128 dims, 16 heads), fp32 model. ``--device cuda``: the 2-layer v32-attention stack
written by transformers, bf16 model, ``--tokens 4096``.

Command: python benchmarks/numerics_vs_transformers.py --out FILE [--seeds 6] [--prompts 3]
         (GPU: bash benchmarks/gpu.sh OUT numerics, which adds --device cuda)
Card: the CPU (default) or one GPU.
Writes: FILE (docs/perf.md "Numerics against transformers").
Prints per numerics the median / max over all (seed, prompt) of the max relative error and the
argmax agreement; the JSON holds every value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

NUMERICS = (("bf16", "bf16", "bf16"), ("fp8_pool_bf16_indexer", "fp8", "bf16"),
            ("fp8_default", "fp8", "fp8"))

CPU_SHAPE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, intermediate_size=192, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, kv_lora_rank=128, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32,
    qk_nope_head_dim=32, n_group=2, topk_group=1, num_experts_per_tok=2, index_topk=64,
    index_head_dim=128, index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=8192)


def _hf_model(path: Path, seed: int, device: str, **config: Any) -> Any:
    import transformers

    cfg = transformers.DeepseekV32Config(**config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.DeepseekV32ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises these to zero / one: make them matter
        for name, t in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t.add_(0.1 * torch.randn_like(t))
    model.save_pretrained(path)
    return model


def _cpkv_last(path: Path, ids: torch.Tensor, kv: str, idx: str, dtype: torch.dtype,
               device: str) -> torch.Tensor:
    from cpkv.comm.group import CPGroup
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    model = load_model(str(path), dtype=dtype, device=device)
    n = ids.numel()
    settings = load_settings(cp={"size": 1}, kv={"dtype": kv, "page_size": 64,
                                                 "pages_per_rank": n // 64 + 8},
                             runtime={"indexer_dtype": idx})
    session = PrefillSession(model, settings, CPGroup.single(device))
    out = session.prefill([("p", ids.tolist())]).last_logits[0].float().cpu()
    session.release("p")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", default="300,700,1000", help="prompt lengths, cycled")
    args = ap.parse_args()
    dev = args.device
    lens = [int(x) for x in args.tokens.split(",")]
    if dev == "cuda":
        from cpkv.bench.gpu import v32_stack
        from cpkv.models.tiny import tiny_config

        shape = tiny_config(**v32_stack(2, max(lens) + 64)).hf_dict()
        shape.pop("architectures", None)
        dtype = torch.bfloat16
    else:
        shape, dtype = dict(CPU_SHAPE), torch.float32
    tmp = Path(tempfile.mkdtemp())
    results: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        for topk_label, topk in (("", shape["index_topk"]), ("_allkeys", max(lens) + 64)):
            path = tmp / f"s{seed}{topk_label}"
            hf = _hf_model(path, seed, dev, **{**shape, "index_topk": topk})
            for p in range(args.prompts):
                n = lens[p % len(lens)]
                ids = torch.randint(0, shape["vocab_size"], (n,),
                                    generator=torch.Generator().manual_seed(100 * seed + p))
                with torch.no_grad():
                    want = hf(ids[None].to(dev)).logits[0, -1].float().cpu()
                for label, kv, idx in NUMERICS:
                    got = _cpkv_last(path, ids, kv, idx, dtype, dev)
                    results.append({
                        "seed": seed, "prompt": p, "tokens": n, "numerics": label + topk_label,
                        "max_rel_err": float((got - want).abs().max() / want.abs().max()),
                        "argmax_equal": bool(got.argmax() == want.argmax())})
                    print(json.dumps(results[-1]), flush=True)
            del hf
    summary: dict[str, Any] = {}
    for label in sorted({r["numerics"] for r in results}):
        errs = [r["max_rel_err"] for r in results if r["numerics"] == label]
        agree = [r["argmax_equal"] for r in results if r["numerics"] == label]
        summary[label] = {"n": len(errs), "median": statistics.median(errs), "max": max(errs),
                          "min": min(errs), "argmax_equal": f"{sum(agree)}/{len(agree)}"}
    # the criterion per (seed, prompt): defaults no worse than the fp8 pool + bf16 indexer
    for suffix in ("", "_allkeys"):
        pairs = {(r["seed"], r["prompt"]): r["max_rel_err"] for r in results
                 if r["numerics"] == "fp8_default" + suffix}
        base = {(r["seed"], r["prompt"]): r["max_rel_err"] for r in results
                if r["numerics"] == "fp8_pool_bf16_indexer" + suffix}
        summary["default_no_worse" + suffix] = f"{sum(pairs[k] <= base[k] for k in pairs)}/" \
                                               f"{len(pairs)}"
    Path(args.out).write_text(json.dumps({"device": dev, "shape": shape, "summary": summary,
                                          "results": results}, indent=1) + "\n")
    for k, v in summary.items():
        print(k, v)


if __name__ == "__main__":
    main()
