"""What holds the device memory at the peak of a long chunked prefill (one GPU).

The 2-layer ``v32-attention`` stack, a prompt of TOKENS prefilled in chunks of CHUNK at a fixed
logits budget (the ``long_1m_budget512_peak_gb`` row of ``cpkv bench long``); the last chunk runs
under ``torch.cuda.memory._record_memory_history``: the live allocations at its peak, grouped by
the innermost cpkv frame that made them, largest first.

Command: bash benchmarks/gpu.sh OUT memory   (1M tokens, 64K chunks, 512 MiB; or
         python benchmarks/memory_peak_gpu.py OUT.json [TOKENS] [CHUNK] [BUDGET_MB])
Card: one GPU with ~40 GB free.
Writes: OUT.json {peak_last_gb, held_before_last_gb, traced_peak_gb, live_at_peak_mb: {line: MB}};
        docs/perf.md "Long prompts".
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


def _site(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "cpkv" in name and "memory_peak" not in name:
            return f"{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def _peak_live(trace: list[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for ev in trace:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            total += ev["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif act == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    by_site: dict[str, int] = defaultdict(int)
    for size, site in best_live.values():
        by_site[site] += size
    return best, dict(sorted(by_site.items(), key=lambda kv: -kv[1]))


def _rank(group: Any, tokens: int, chunk: int, budget: int, ckpt: str) -> dict[str, Any]:
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    dev = group.device
    model = load_model(ckpt, dtype=torch.bfloat16, device=dev)
    settings = load_settings(cp={"size": 1},
                             kv={"dtype": "fp8", "page_size": 64,
                                 "pages_per_rank": tokens // 64 + 64},
                             runtime={"logits_budget_mb": budget})
    session = PrefillSession(model, settings, group)
    ids = torch.randint(0, model.config.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(0))
    last = ((tokens - 1) // chunk) * chunk
    torch.cuda.reset_peak_memory_stats(dev)
    for s in range(0, last, chunk):
        session.prefill([("p", ids[s:s + chunk])])
    torch.cuda.synchronize(dev)
    before_last = torch.cuda.max_memory_allocated(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    session.prefill([("p", ids[last:])])
    torch.cuda.synchronize(dev)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_last = torch.cuda.max_memory_allocated(dev)
    best, by_site = _peak_live(snap["device_traces"][0])
    return {"tokens": tokens, "chunk": chunk, "budget_mb": budget,
            "peak_before_last_gb": before_last / 1e9, "peak_last_gb": peak_last / 1e9,
            "held_before_last_gb": base / 1e9, "traced_peak_gb": best / 1e9,
            "live_at_peak_mb": {k: round(v / 1e6, 1) for k, v in by_site.items()}}


def main() -> None:
    from cpkv.bench.gpu import v32_stack
    from cpkv.models import write_tiny_checkpoint
    from cpkv.runtime import run_ranks

    out = Path(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 65536
    budget = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    stack = v32_stack(2, tokens)
    ckpt = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "stack", seed=0, **stack))
    rep = run_ranks(_rank, 1, args=(tokens, chunk, budget, ckpt), backend="nccl",
                    timeout_s=1800)[0].value
    out.write_text(json.dumps(rep, indent=1))
    print(f"peak before the last chunk {rep['peak_before_last_gb']:.3f} GB; last chunk "
          f"{rep['peak_last_gb']:.3f} GB = {rep['held_before_last_gb']:.3f} held + "
          f"{rep['traced_peak_gb']:.3f} traced")
    for site, mb in list(rep["live_at_peak_mb"].items())[:20]:
        print(f"{mb:10.1f} MB  {site}")


if __name__ == "__main__":
    main()
