"""SM clock and board power while the fp8 matmul, the bf16 matmul, cpkv's prefill indexer and
DeepGEMM's (when built) each run back to back for PHASE seconds: ``nvidia-smi`` samples the SM
clock, the power draw and the clock-event reasons every 50 ms; a phase's row gives its TFLOP/s
and the median clock and power of its samples. Says whether a kernel is held by its schedule or
by the card's power limit.

Command: bash benchmarks/gpu.sh OUT clock   (python benchmarks/clock_probe_gpu.py OUT.json)
Card: one GPU; DeepGEMM's phase needs .dg (gpu.sh builds it).
Writes: OUT.json {gpu, rows: [{phase, tflops, ms, samples, sm_mhz, power_w, reasons}]};
        docs/perf.md "Clock at the power limit".
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

sys.path.insert(0, "benchmarks")
from indexer_sweep_gpu import fp8_inputs

PHASE = 4.0
_Q = "clocks.sm,power.draw,clocks_event_reasons.active"


class Sampler:
    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float, str]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={_Q}", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.monotonic(), float(parts[0]), float(parts[1]), parts[2]))
            except (ValueError, IndexError):
                continue

    def window(self, t0: float, t1: float) -> dict[str, object]:
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return {"samples": 0}
        reasons: dict[str, int] = {}
        for s in got:
            reasons[s[3]] = reasons.get(s[3], 0) + 1
        return {"samples": len(got), "sm_mhz": statistics.median(s[1] for s in got),
                "power_w": statistics.median(s[2] for s in got), "reasons": reasons}

    def stop(self) -> None:
        self.proc.terminate()


def sustained(fn: Callable[[], object], seconds: float, sampler: Sampler) -> dict[str, object]:
    """``fn``'s mean ms at the card's power limit (:func:`cpkv.bench.gpu.sustained_ms`: back to
    back for ``seconds``, then timed) and the clock and power sampled meanwhile (the first
    0.5 s, while the clock settles, left out)."""
    from cpkv.bench.gpu import sustained_ms

    t0 = time.monotonic()
    ms = sustained_ms(fn, seconds)
    return {"ms": ms, **sampler.window(t0 + 0.5, time.monotonic())}


def phase(name: str, fn: Callable[[], object], flops: float, sampler: Sampler) -> dict[str, object]:
    got = sustained(fn, PHASE, sampler)
    row = {"phase": name, "tflops": flops / float(got["ms"]) / 1e9, **got}  # type: ignore[arg-type]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from cpkv_backend_triton.attention import AttentionKernels

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    sampler = Sampler()
    time.sleep(1.0)
    rows = [{"phase": "idle", **sampler.window(0, time.monotonic())}]
    n = 8192
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    rows.append(phase("scaled_mm_8192", lambda: torch._scaled_mm(a, b, one, one,
                                                                 out_dtype=torch.bfloat16),
                      2 * n ** 3, sampler))
    bb = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    rows.append(phase("bf16_mm_8192", lambda: bb @ bb, 2 * n ** 3, sampler))
    q8, w8, k8, sc, ks, ke = fp8_inputs(4096, 131072, dev, g)
    flops = 2 * 64 * 128 * float((ke - ks).sum())
    ak = AttentionKernels()
    rows.append(phase("cpkv_indexer_4096x128K", lambda: ak.indexer_logits(q8, w8, k8, sc, ks, ke),
                      flops, sampler))
    try:
        from cpkv_backend_cuda.plugin import deepgemm_ops

        dgo = deepgemm_ops()
        ks32, ke32 = ks.to(torch.int32), ke.to(torch.int32)
        rows.append(phase("deepgemm_4096x128K",
                          lambda: dgo.compressed_logits(q8, w8, k8, sc, ks32, ke32), flops,
                          sampler))
    except Exception as e:  # DeepGEMM absent: the row says so
        rows.append({"phase": "deepgemm_4096x128K", "absent": f"{type(e).__name__}: {e}"[:200]})
    sampler.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
