"""The fused indexer top-k (``cpkv_backend_triton.indexer_topk``) on one GPU against the plain
path (the Triton indexer writing the logits, then the Triton top-k), DeepSeek-V3.2's fp8
numerics (64 heads x 128, fp8 queries with their scales in the head weights, ue8m0 fp8 keys),
causal ranges of a prompt's last rows. Writes one JSON object to OUT (argv[1]):

* ``edge``: the conformance suite's ``indexer_topk`` check compiled, with the fused path forced
  at its small sizes (MIN_T 1, a 64-column sample, small tiles) and with the defaults, and the
  interpreter tests' forced cases (a floor above the k-th key, ties overflowing CAP, ties within
  CAP): each True when it chose the reference's set.
* ``cases``: per (rows, keys): the fused set equal to the plain path's in every row (and the
  rows that differ), the rows the select flagged, no host sync (``set_sync_debug_mode``),
  device milliseconds (median, CUDA events after a spin kernel) of the plain indexer, the
  plain top-k on its logits, both, and the fused op; ``fused_topk_share`` = (fused - plain
  indexer) / plain indexer, the top-k share with the filter's epilogue counted as top-k
  work; a per-kernel profile of one fused call.
  ``filter_over_indexer``: the fused filter kernel's time (the profile's) over the plain
  indexer kernel's: what the candidate append in the epilogue costs.
* ``flagged``: the exact pass's cost: every long row forced to it (CAP_MAX 16).
* ``recent``: rows whose candidates crowd the keys' last sixteenth (a recency bias): the rows
  flagged (a row's CAP does not depend on where its candidates lie) and the time.

The fused path is forced on (MIN_T 196608, the long-row top-k's) whatever the table says.

Command: bash benchmarks/gpu.sh OUT indexer_topk   (python benchmarks/indexer_topk_gpu.py OUT.json)
Card: one GPU with fp8 tensor cores.
Writes: OUT.json {device, k, config, edge, cases, flagged, recent};
        docs/perf.md "The fused indexer top-k".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from topk_long_sweep_gpu import OPS, override  # benchmarks/ is the script's sys.path[0]

import cpkv.testing.conformance as conf
import cpkv_backend_triton.indexer_topk as F
from cpkv.bench.gpu import kernel_profile
from cpkv.bench.timing import device_ms
from cpkv.ops import quantize_fp8, quantize_index_q
from cpkv.runtime.job.results import compare_topk
from cpkv_backend_triton import tuning
from cpkv_backend_triton.attention import AttentionKernels

K = 2048
SMALL = {"MIN_T": 1, "SAMPLE": 64, "CAP_MIN": 16, "BLOCK_M": 16, "BLOCK_N": 32,
         "SELECT_BLOCK": 32, "EXACT_BLOCK_N": 32}
#: over the table's row: the fused path from 192K keys (the long-row top-k's MIN_T)
DEFAULT = {"MIN_T": 196608}


def use(cfg: dict[str, int]) -> None:
    """``INDEXER_TOPK``'s launch constants for the calls that follow (the table's row, then these)."""
    override("INDEXER_TOPK", cfg)


def same_set(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor) -> bool:
    """The same top-k sets up to keys tied at the k-th score (the conformance suite's rule)."""
    def scores(idx: torch.Tensor) -> torch.Tensor:
        return logits.gather(1, idx.long().clamp(min=0)).cpu()

    return compare_topk([got.cpu()], [scores(got)], [want.cpu()], [scores(want)],
                        rel_tie=conf.TOPK_TIE_REL) == 0


def inputs(n: int, t: int, seed: int = 0, recent: bool = False) -> tuple[torch.Tensor, ...]:
    """fp8 queries (scales in the weights), fp8 keys, causal tail ranges. ``recent``: positive
    head weights and the last sixteenth of the keys shifted towards the queries' mean
    direction, so each row's top candidates crowd its last keys (a recency bias)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(n, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(n, 64, generator=g, device="cuda") * (64 * 128) ** -0.5
    k = torch.randn(t, 128, generator=g, device="cuda")
    if recent:
        w = w.abs()
        d = q.float().mean(dim=(0, 1))
        k[t - t // 16:] += d / d.norm() * 1.5
    q8, w8 = quantize_index_q(q, w)
    k8, scale = quantize_fp8(k, None, "ue8m0")
    ks = torch.zeros(n, dtype=torch.int64, device="cuda")
    ke = torch.arange(t - n + 1, t + 1, device="cuda")
    return q8, w8, k8, scale, ks, ke


@contextmanager
def flag_spy() -> Iterator[list[int]]:
    """The number of rows the select flags, per fused call inside."""
    seen: list[int] = []
    real = F.select_fused

    def spy(val: torch.Tensor, col: torch.Tensor, count: torch.Tensor, key_start: torch.Tensor,
            key_end: torch.Tensor, out: torch.Tensor, meta: torch.Tensor, t: int, k: int,
            cap: int) -> None:
        real(val, col, count, key_start, key_end, out, meta, t, k, cap)
        long = (key_end.clamp(0, t) - key_start.clamp(0, t)) > k
        seen.append(int((long & (meta[:, 0] < 0)).sum()))

    F.select_fused = spy
    try:
        yield seen
    finally:
        F.select_fused = real


def edge(ref: Any) -> dict[str, bool]:
    """Compiled small cases (module docstring), every call of more than 0 rows fused."""
    impl = AttentionKernels(indexer_config={"FEW_ROWS": 0})
    out: dict[str, bool] = {}
    for name, cfg in (("forced", {**DEFAULT, **SMALL}), ("default", DEFAULT)):
        use(cfg)
        try:
            conf.check_op(impl, ref, "indexer_topk", device="cuda")
            out[f"conformance_{name}"] = True
        except AssertionError as exc:
            print(f"conformance {name}: {exc}", flush=True)
            out[f"conformance_{name}"] = False
    use({**DEFAULT, **SMALL})
    g = torch.Generator().manual_seed(5)
    n, t, k = 12, 1024, 16
    q = torch.randn(n, 4, 32, generator=g).abs()[0:1].expand(n, 4, 32).contiguous()
    w = torch.rand(n, 4, generator=g)
    base = torch.randn(t, 32, generator=g)
    keys = base.clone()
    stride = F.layout(n, t, k).stride
    cols = keys[::stride].shape[0]
    keys[::stride] = keys[0].abs() * (4.0 + torch.arange(cols, dtype=torch.float32)[:, None])
    ks, ke = torch.zeros(n, dtype=torch.int64), torch.arange(t - n + 1, t + 1)
    cases = {"floor_too_high": (q, w, keys),
             "ties_overflow": (q, w, base[0:1].expand(t, 32).contiguous()),
             "ties_within_cap": (q, w, torch.cat([base[:100], base[0:1].abs().expand(40, 32) * 3,
                                                  base[140:]]))}
    for name, (qq, ww, kk) in cases.items():
        use({**DEFAULT, **SMALL, "CAP_MAX": 16} if name == "ties_overflow" else
            {**DEFAULT, **SMALL})
        qc, wc, kc = qq.cuda(), ww.cuda(), kk.cuda()
        with flag_spy() as flags:
            got = impl.indexer_topk(qc, wc, kc, None, ks.cuda(), ke.cuda(), k)
        print(json.dumps({name: {"flagged_rows": flags}}), flush=True)
        logits = ref.indexer_logits(qc, wc, kc, None, ks.cuda(), ke.cuda())
        out[name] = same_set(got, ref.topk(logits, k, ks.cuda(), ke.cuda()), logits)
    use(DEFAULT)
    return out


def case(impl: Any, n: int, t: int) -> dict[str, Any]:
    q8, w8, k8, sc, ks, ke = inputs(n, t)
    with flag_spy() as flags:
        fused = impl.indexer_topk(q8, w8, k8, sc, ks, ke, K)
    logits = impl.indexer_logits(q8, w8, k8, sc, ks, ke)
    plain = impl.topk(logits, K, ks, ke)
    same = (fused.sort(1).values == plain.sort(1).values).all(1)
    res: dict[str, Any] = {"rows": n, "keys": t, "layout": F.layout(n, t, K).__dict__,
                           "sets_equal": bool(same.all()), "rows_differ": int((~same).sum()),
                           "outputs_equal": bool(torch.equal(fused, plain)),
                           "flagged_rows": flags[0] if flags else None}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the op reads nothing back to the host
    try:
        impl.indexer_topk(q8, w8, k8, sc, ks, ke, K)
        res["no_host_sync"] = True
    except RuntimeError as exc:
        print(f"host sync: {exc}", flush=True)
        res["no_host_sync"] = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    res["plain_indexer_ms"] = device_ms(partial(impl.indexer_logits, q8, w8, k8, sc, ks, ke),
                                        iters=10)
    res["plain_topk_ms"] = device_ms(partial(impl.topk, logits, K, ks, ke), iters=10)
    del logits
    torch.cuda.empty_cache()
    res["plain_ms"] = device_ms(lambda: impl.topk(impl.indexer_logits(q8, w8, k8, sc, ks, ke),
                                                  K, ks, ke), iters=10)
    res["fused_ms"] = device_ms(partial(impl.indexer_topk, q8, w8, k8, sc, ks, ke, K), iters=10)
    idx = res["plain_indexer_ms"]
    res["plain_topk_share"] = res["plain_topk_ms"] / idx
    res["fused_topk_share"] = (res["fused_ms"] - idx) / idx
    res["fused_speedup"] = res["plain_ms"] / res["fused_ms"]
    res["fused_kernels"] = kernel_profile(partial(impl.indexer_topk, q8, w8, k8, sc, ks, ke, K),
                                          top=8)
    filt = [r["ms"] for r in res["fused_kernels"] if "_fused_filter_kernel" in r.get("kernel", "")]
    res["filter_over_indexer"] = filt[0] / idx if filt else None
    print(json.dumps({k: v for k, v in res.items() if k != "fused_kernels"}), flush=True)
    return res


def flagged(impl: Any, n: int, t: int) -> dict[str, Any]:
    """Every long row through the exact pass (CAP_MAX 16: every split overflows)."""
    q8, w8, k8, sc, ks, ke = inputs(n, t, seed=2)
    want = impl.topk(impl.indexer_logits(q8, w8, k8, sc, ks, ke), K, ks, ke)
    use({**DEFAULT, "CAP_MIN": 16, "CAP_MAX": 16})
    with flag_spy() as flags:
        got = impl.indexer_topk(q8, w8, k8, sc, ks, ke, K)
    ms = device_ms(partial(impl.indexer_topk, q8, w8, k8, sc, ks, ke, K), warmup=1, iters=3)
    use(DEFAULT)
    normal = device_ms(partial(impl.indexer_topk, q8, w8, k8, sc, ks, ke, K), iters=5)
    same = (got.sort(1).values == want.sort(1).values).all(1)
    res = {"rows": n, "keys": t, "flagged_rows": flags[0] if flags else None,
           "rows_differ_from_plain": int((~same).sum()), "all_flagged_ms": ms,
           "unflagged_ms": normal, "ms_per_flagged_row": (ms - normal) / n}
    print(json.dumps(res), flush=True)
    return res


def recent(impl: Any, n: int, t: int) -> dict[str, Any]:
    """Candidates crowding the last keys (:func:`inputs` ``recent``): rows flagged, time, and
    the set against the plain path's."""
    q8, w8, k8, sc, ks, ke = inputs(n, t, seed=4, recent=True)
    plain = impl.topk(impl.indexer_logits(q8, w8, k8, sc, ks, ke), K, ks, ke).sort(1).values
    with flag_spy() as flags:
        got = impl.indexer_topk(q8, w8, k8, sc, ks, ke, K)
    ms = device_ms(partial(impl.indexer_topk, q8, w8, k8, sc, ks, ke, K), warmup=1, iters=3)
    r = {"rows": n, "keys": t, "cap": F.layout(n, t, K).cap,
         "flagged_rows": flags[0] if flags else None, "ms": ms,
         "rows_differ_from_plain": int((got.sort(1).values != plain).any(1).sum())}
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    from cpkv.plugin import PluginHost

    backends = PluginHost().backends()
    use(DEFAULT)
    impl = OPS
    ref = backends.load("torch")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "k": K,
                              "config": dict(tuning.tuned(tuning.Launch.INDEXER_TOPK))}
    result["edge"] = edge(ref)
    print(json.dumps({"edge": result["edge"]}), flush=True)
    result["cases"] = [case(impl, n, t) for n, t in ((1024, 524288), (4096, 262144),
                                                     (8192, 524288))]
    torch.cuda.empty_cache()
    result["flagged"] = flagged(impl, 256, 524288)
    result["recent"] = recent(impl, 1024, 524288)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
