"""``long_1m_first_pass_ratio``: a fresh process's first pass over a long prompt against its
second, after the warm-up (:func:`cpkv.runtime.warmup.warm_up`), whose own time is reported.

One process, one GPU, the 2-layer ``v32-attention`` stack with the default settings: the
compile caches (Triton's and DeepGEMM's) pointed at ``--cache-dir`` (empty it for a fresh
machine's case; keep a warm-up's for the persistent cache's case), then the warm-up (``--warmup
0``: none), then the prompt in ``--chunk`` chunks twice (pass 1, pass 2), then once in
``--second-chunk`` chunks. Every phase lists the kernels compiled in each chunk (new entries of
the caches). Row: pass 1 seconds over pass 2 seconds; ``detail``: the warm-up's time, each
chunk's time and compiles, and whether the last-token logits are equal across the passes and
chunkings (bit for bit).

Run: ``python -m cpkv.bench.first_pass --out FILE --cache-dir DIR``
(``bash benchmarks/gpu.sh OUT first_pass``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

__all__ = ["main"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache-dir", required=True, help="the compile caches' folder")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--second-chunk", type=int, default=0, help="0: no second chunking")
    ap.add_argument("--warmup", type=int, default=-1,
                    help="warm-up tokens (-1: --tokens; 0: no warm-up)")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    # before torch, triton or deep_gemm is imported: they read these once
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    os.environ["DG_JIT_CACHE_DIR"] = str(cache / "deep_gemm")
    t_import = time.perf_counter()

    import torch

    from cpkv.bench.gpu import v32_stack
    from cpkv.bench.report import BenchReport, BenchRow, machine_description
    from cpkv.comm.group import CPGroup
    from cpkv.models import load_model, write_tiny_checkpoint
    from cpkv.runtime.session import PrefillSession
    from cpkv.runtime.warmup import compiled_kernels, warm_up
    from cpkv.settings import load_settings

    before = compiled_kernels()  # the caches the variables above name; imports compile nothing
    dev = torch.device("cuda", 0)
    n = args.tokens
    tmp = Path(tempfile.mkdtemp())
    ckpt = write_tiny_checkpoint(tmp / "stack", seed=0, **v32_stack(args.layers, n))
    model = load_model(str(ckpt), dtype=torch.bfloat16, device=dev)
    group = CPGroup.single(dev)
    settings = load_settings(cp={"size": 1},
                             kv={"page_size": 64, "pages_per_rank": n // 64 + 64})
    session = PrefillSession(model, settings, group)
    detail: dict[str, Any] = {"ops": dict(session.ops.chosen),
                              "kv_dtype": str(session.settings.kv.dtype),
                              "indexer_dtype": session.settings.runtime.indexer_dtype,
                              "cache_entries_at_start": len(before),
                              "startup_s": time.perf_counter() - t_import}
    seen = compiled_kernels()
    warm = n if args.warmup < 0 else args.warmup
    if warm:
        rep = warm_up(session, warm, args.chunk)
        now = compiled_kernels()
        detail["warmup"] = {"tokens": warm, "chunk": rep.chunk, "seconds": rep.seconds,
                            "chunk_seconds": list(rep.chunk_seconds),
                            "compiled": sorted(now - seen)}
        seen = now
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
    logits: dict[str, torch.Tensor] = {}

    def one_pass(name: str, c: int) -> float:
        nonlocal seen
        per, compiled = [], []
        start = time.perf_counter()
        res = None
        for s in range(0, n, c):
            t = time.perf_counter()
            res = session.prefill([(name, cast(Sequence[int], ids[s:s + c]))])
            torch.cuda.synchronize(dev)
            per.append(time.perf_counter() - t)
            now = compiled_kernels()
            compiled.append(sorted(now - seen))
            seen = now
        seconds = time.perf_counter() - start
        session.release(name)
        assert res is not None
        logits[name] = res.last_logits[0].float().cpu()
        detail[name] = {"chunk": c, "seconds": seconds, "chunk_seconds": per,
                        "compiled_per_chunk": compiled}
        print(f"{name}: {seconds:.2f} s, chunks {min(per):.2f}-{max(per):.2f} s, "
              f"{sum(map(len, compiled))} kernels compiled", flush=True)
        return seconds

    first = one_pass("pass1", args.chunk)
    second = one_pass("pass2", args.chunk)
    equal = {"pass1_vs_pass2": torch.equal(logits["pass1"], logits["pass2"])}
    if args.second_chunk:
        one_pass("pass3", args.second_chunk)
        equal[f"chunks_{args.chunk}_vs_{args.second_chunk}"] = torch.equal(logits["pass1"],
                                                                           logits["pass3"])
    detail["logits_equal"] = equal
    tag = f"{n >> 20}m" if n >= 1 << 20 else f"{n >> 10}k"
    rows = [BenchRow.of(f"long_{tag}_first_pass_ratio", first, "s",
                        "the same process's second pass (s)", second)]
    cmd = "python -m cpkv.bench.first_pass " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    rep_out = BenchReport(machine=machine_description(), command=cmd, results=tuple(rows),
                          detail=detail)
    rep_out.write(args.out)
    print(f"{rows[0].name}: {first:.2f} s / {second:.2f} s = {rows[0].ratio:.3f}; warm-up "
          f"{detail.get('warmup', {}).get('seconds', 0.0):.1f} s; logits equal {equal}")


if __name__ == "__main__":
    main()
