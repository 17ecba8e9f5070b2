"""GPU benchmarks: kernels against the torch backend and the ceilings measured in the
same run, materialization against a raw all-gather of the same bytes, CP2 against CP1 prefill.

Backends are reached through the registry only (``load("triton")``, ``load("torch")``). Timings:
kernels, copies and collectives in GPU time (:func:`cpkv.bench.timing.device_ms`: the host's
launch work hidden behind a spin kernel, as inside a prefill where the host runs ahead), their
eager call times (host launch work included) kept under ``detail``; prefills in wall time.
Every row is a :class:`BenchRow` with a same-run baseline.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from cpkv.contracts import KVFormat, KVOps
from cpkv.plugin import PluginHost

from .report import BenchRow
from .timing import device_ms, median_ms

if TYPE_CHECKING:
    from cpkv.kv import AllGatherViews, BatchKV, MaterializePlan, ShardedKVPool

__all__ = [
    "GpuBenchOptions",
    "attention_stack",
    "ceilings",
    "cuda_ms",
    "kernel_profile",
    "kernel_rows",
    "layer_flops",
    "materialize_rank",
    "prefill_rank",
    "run",
    "stack_flops",
    "v32_stack",
]

PAGE = 64
TOKENS_64K = 64 * 1024


def attention_stack(preset: str, layers: int, positions: int = 0,
                    **overrides: Any) -> dict[str, Any]:
    """The checkpoint config of a GPU benchmark's stack: the ``preset`` (``v32-attention``,
    ``glm5-attention``: :data:`cpkv.models.tiny.PRESETS`) with ``layers`` dense layers (a GLM-5
    preset continues its indexer schedule over them: full, shared, full, ...), its max position
    raised to hold ``positions`` (``overrides`` last, e.g. ``num_nextn_predict_layers``)."""
    from cpkv.models.tiny import PRESETS

    base = PRESETS[preset]
    return {**base, "num_hidden_layers": layers, "first_k_dense_replace": layers,
            "max_position_embeddings": max(int(base.get("max_position_embeddings", 4096)),
                                           positions),
            **overrides}


def v32_stack(layers: int, positions: int = 0, **overrides: Any) -> dict[str, Any]:
    """:func:`attention_stack` of the ``v32-attention`` preset."""
    return attention_stack("v32-attention", layers, positions, **overrides)


def cuda_ms(fn: Callable[[], Any], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (see :func:`median_ms`)."""
    return median_ms(fn, "cuda", warmup, iters)


def ceilings(dev: torch.device, sustained_s: float = 0.0) -> dict[str, float]:
    """Device copy bandwidth (read + write, GB/s) of 1 GiB, the bf16 matmul rate and (GPUs with
    fp8 tensor cores) the fp8 e4m3 ``torch._scaled_mm`` rate at 8192^3 (TFLOP/s), GPU time,
    measured now: each call after an idle lead (:func:`device_ms`), so at the card's boost
    clock. ``sustained_s > 0`` adds ``fp8_matmul_sustained_tflops``: the same matmul back to
    back for that long, then timed over 64 more calls: the rate at the card's power limit, the
    ceiling of a workload that runs for seconds (on a 700 W card ~0.85 of the burst rate, at
    ~0.65 of the boost clock: docs/perf.md "Clock at the power limit")."""
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = device_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    mm = device_ms(lambda: a @ b, iters=10)
    out = {"copy_gbps": 2 * (1 << 30) / ms / 1e6, "matmul_tflops": 2 * 8192 ** 3 / mm / 1e9}
    if torch.cuda.get_device_capability(dev) >= (8, 9):  # fp8 tensor cores
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes
        one = torch.ones((), dtype=torch.float32, device=dev)
        mm8 = device_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                        iters=10)
        out["fp8_matmul_tflops"] = 2 * 8192 ** 3 / mm8 / 1e9
        if sustained_s > 0:
            out["fp8_matmul_sustained_tflops"] = 2 * 8192 ** 3 / sustained_ms(
                lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                sustained_s) / 1e9
    return out


def sustained_ms(fn: Callable[[], Any], seconds: float, iters: int = 64) -> float:
    """Mean GPU milliseconds of ``fn`` after running it back to back for ``seconds`` (the card
    at its power limit, as in a long prompt's prefill), over ``iters`` more back-to-back calls."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(8):
            fn()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / iters


def _backends() -> tuple[KVOps, KVOps | None, str]:
    host = PluginHost()
    reg = host.backends()
    ref = reg.load("torch")
    av = reg.availability("triton")
    fast = reg.load("triton") if av.available else None
    host.close()
    return ref, fast, "" if av.available else av.reason


def kernel_rows(dev: torch.device, ceil: dict[str, float], detail: dict[str, Any]) -> list[BenchRow]:
    """gather/scatter/rerange at 64K tokens vs copy bandwidth; indexer logits and sparse MLA vs
    the torch backend (TFLOP/s on the FLOPs actually needed)."""
    ref, fast, why = _backends()
    detail["triton"] = "available" if fast is not None else f"unavailable: {why}"
    impl = fast or ref
    rows: list[BenchRow] = []
    g = torch.Generator(device=dev).manual_seed(0)
    copy = ceil["copy_gbps"]

    def moved(name: str, nbytes: int, fast_fn: Callable[[], Any], ref_fn: Callable[[], Any],
              like: torch.Tensor) -> None:
        """A row-moving kernel: GPU bandwidth against a device copy of the same bytes (the
        ceiling for moving them; a 52 MB copy runs below the 1 GiB copy's rate)."""
        dst = torch.empty_like(like)
        t = {"ms": device_ms(fast_fn), "torch_ms": device_ms(ref_fn),
             "copy_ms": device_ms(lambda: dst.copy_(like)),
             "eager_ms": cuda_ms(fast_fn), "torch_eager_ms": cuda_ms(ref_fn)}
        rows.append(BenchRow.of(name, nbytes / t["ms"] / 1e6, "GB/s",
                                "device copy of the same bytes (same run)",
                                nbytes / t["copy_ms"] / 1e6))
        detail[name.removesuffix("_bw")] = {**t, "bytes": nbytes,
                                            "ratio_vs_1gib_copy": nbytes / t["ms"] / 1e6 / copy,
                                            "speedup_vs_torch": t["torch_ms"] / t["ms"]}

    # page gather / scatter: 1024 pages of 64 tokens x (656 + 132) B (fp8 latent + index-K)
    fmt = KVFormat.deepseek_v32("fp8")
    pool = torch.randint(0, 255, (4096, PAGE, fmt.bytes_per_token), dtype=torch.uint8, device=dev,
                         generator=g)
    idx = torch.randperm(4096, device=dev, generator=g)[:1024]
    src = torch.randint(0, 255, (1024, PAGE, fmt.bytes_per_token), dtype=torch.uint8, device=dev,
                        generator=g)
    nbytes = 2 * src.numel()
    moved("gather_64k_bw", nbytes, lambda: impl.page_gather(pool, idx),
          lambda: ref.page_gather(pool, idx), src)
    moved("scatter_64k_bw", nbytes, lambda: impl.page_scatter(pool, idx, src),
          lambda: ref.page_scatter(pool, idx, src), src)
    # the page movement of each layout (kv.layout), every row against a device copy of the same
    # bytes. part_major: a page is one block too, moved whole (the all-gather's send buffer,
    # copies on write, the host tier, a transfer between pools of one layout): the same kernel
    # on a part-major pool. two_part (a latent tensor and a DeepGEMM-order index-K tensor):
    # whole pages move region by region (two page gathers / scatters: copies on write, the host
    # tier, a transfer between two-part pools), and are read out as / written from canonical
    # blocks where the bytes change layout (the all-gather's send buffer, a transfer into the
    # part-major decode pool); the canonical rows are torch ops only (its "torch" timing is the
    # same call)
    from cpkv.kv.buffers import KVBufferSpec, read_pages, write_pages

    nl = fmt.latent_bytes_per_token
    part = torch.cat([pool[..., :nl].reshape(4096, -1), pool[..., nl:].reshape(4096, -1)],
                     dim=1).view(4096, PAGE, -1)  # the same pages, part-major
    moved("part_major_gather_64k_bw", nbytes, lambda: impl.page_gather(part, idx),
          lambda: ref.page_gather(part, idx), src)
    moved("part_major_scatter_64k_bw", nbytes, lambda: impl.page_scatter(part, idx, src),
          lambda: ref.page_scatter(part, idx, src), src)
    two = KVBufferSpec.wrap(fmt, "two_part", [(pool[..., :nl].contiguous(),
                                                pool[..., nl:].contiguous().view(4096, -1))])
    regions = two.regions(0)
    region_src = [torch.empty(1024, r.shape[1], dtype=torch.uint8, device=dev) for r in regions]

    def region_moves(k: KVOps, scatter: bool) -> Callable[[], None]:
        def run() -> None:
            for r, s_ in zip(regions, region_src, strict=True):
                if scatter:
                    k.page_scatter(r, idx, s_)
                else:
                    k.page_gather(r, idx)
        return run

    moved("two_part_region_gather_64k_bw", nbytes, region_moves(impl, False),
          region_moves(ref, False), src)
    moved("two_part_region_scatter_64k_bw", nbytes, region_moves(impl, True),
          region_moves(ref, True), src)
    for name, fn in (("two_part_gather_64k_bw", partial(read_pages, two, 0, idx)),
                     ("two_part_scatter_64k_bw", partial(write_pages, two, 0, idx, src))):
        moved(name, nbytes, fn, fn, src)

    # rerange: 64K hidden rows of 7168 bf16 gathered rank-major from 2 ranks
    hidden = torch.randn(TOKENS_64K, 7168, dtype=torch.bfloat16, device=dev, generator=g)
    perm = torch.randperm(TOKENS_64K, device=dev, generator=g)
    moved("rerange_64k_bw", 2 * hidden.numel() * 2, lambda: impl.rerange(hidden, perm),
          lambda: ref.rerange(hidden, perm), hidden)

    # indexer logits: 1024 query rows (the end of a 32K prompt) x 32K keys, 64 heads x 128
    n, t, h, d = 1024, 32 * 1024, 64, 128
    q = torch.randn(n, h, d, dtype=torch.bfloat16, device=dev, generator=g)
    w = torch.randn(n, h, dtype=torch.float32, device=dev, generator=g) * 0.1
    k = torch.randn(t, d, dtype=torch.bfloat16, device=dev, generator=g)
    ks = torch.zeros(n, dtype=torch.int64, device=dev)
    ke = torch.arange(t - n + 1, t + 1, dtype=torch.int64, device=dev)
    flops = 2 * h * d * float((ke - ks).sum())
    t_fast = device_ms(lambda: impl.indexer_logits(q, w, k, None, ks, ke), iters=10)
    # the reference launches many ops: a longer lead keeps its host work hidden too
    t_ref = device_ms(lambda: ref.indexer_logits(q, w, k, None, ks, ke), iters=5, lead_ms=50)
    rows.append(BenchRow.of("indexer_logits_32k_speedup", flops / t_fast / 1e9, "TFLOP/s",
                            "torch backend, same FLOPs (TFLOP/s)", flops / t_ref / 1e9))
    logits = impl.indexer_logits(q, w, k, None, ks, ke)
    t_topk = device_ms(lambda: impl.topk(logits, 2048, ks, ke), iters=10)
    detail["indexer_logits_32k"] = {"ms": t_fast, "torch_ms": t_ref, "causal_flops": flops,
                                    "topk_ms": t_topk}
    # the same with fp8 keys (an fp8 pool's: rotated, ue8m0) and fp8 queries (DeepSeek's
    # indexer, runtime.indexer_dtype "fp8"/"auto") against bf16 queries on the same fp8 keys
    from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q

    k8, k_scale = quantize_fp8(hadamard_rotate(k), None, "ue8m0")
    q = hadamard_rotate(q)
    q8, w8 = quantize_index_q(q, w)
    t_bf16 = device_ms(lambda: impl.indexer_logits(q, w, k8, k_scale, ks, ke), iters=10)
    t_fp8 = device_ms(lambda: impl.indexer_logits(q8, w8, k8, k_scale, ks, ke), iters=10)
    a = impl.indexer_logits(q8, w8, k8, k_scale, ks, ke)
    b = ref.indexer_logits(q8[:64], w8[:64], k8, k_scale, ks[:64], ke[:64])
    fin = b.isfinite()
    rows.append(BenchRow.of("indexer_logits_32k_fp8_speedup", flops / t_fp8 / 1e9, "TFLOP/s",
                            "bf16 queries on the same fp8 keys (TFLOP/s)", flops / t_bf16 / 1e9))
    if "fp8_matmul_tflops" in ceil:
        rows.append(BenchRow.of("indexer_logits_32k_fp8_mfu", flops / t_fp8 / 1e9, "TFLOP/s",
                                "fp8 matmul ceiling (same run)", ceil["fp8_matmul_tflops"]))
    detail["indexer_logits_32k_fp8"] = {
        "ms": t_fp8, "bf16_q_ms": t_bf16,
        "max_rel_err_vs_torch": float((a[:64][fin] - b[fin]).abs().max() / b[fin].abs().max())}

    # sparse MLA prefill: 1024 queries x 128 heads, 576/512, top-2048 over a 64K-key view
    n, h, dk, dv, kk = 1024, 128, 576, 512, 2048
    q = torch.randn(n, h, dk, dtype=torch.bfloat16, device=dev, generator=g)
    kv = torch.randn(TOKENS_64K, dk, dtype=torch.bfloat16, device=dev, generator=g)
    ind = torch.randint(0, TOKENS_64K, (n, kk), dtype=torch.int32, device=dev, generator=g)
    flops = 2.0 * n * h * kk * (dk + dv)
    scale = dk ** -0.5
    t_fast = device_ms(lambda: impl.sparse_mla(q, kv, ind, scale, dv), iters=10)
    t_ref = device_ms(lambda: _chunked_ref_mla(ref, q, kv, ind, scale, dv), iters=3, lead_ms=50)
    mla: dict[str, Any] = {"triton_ms": t_fast, "torch_ms": t_ref, "flops": flops,
                           "triton_tflops": flops / t_fast / 1e9}
    cuda, why = _cuda_backend()
    if cuda is None:  # FlashMLA not here: Triton against the torch reference
        mla["cuda"] = f"unavailable: {why}"
        rows.append(BenchRow.of("sparse_mla_prefill_64k_tflops", flops / t_fast / 1e9, "TFLOP/s",
                                "torch backend (TFLOP/s)", flops / t_ref / 1e9))
    else:  # the cuda backend (FlashMLA through cpkv's op) against FlashMLA called directly
        import flash_mla  # type: ignore[import-not-found]  # there when the backend is

        t_cuda = device_ms(lambda: cuda.sparse_mla(q, kv, ind, scale, dv), iters=10)
        q3, kv3, ind3 = q.contiguous(), kv.unsqueeze(1), ind.unsqueeze(1)
        t_direct = device_ms(lambda: flash_mla.flash_mla_sparse_fwd(q3, kv3, ind3, scale, dv,
                                                                    use_legacy=True), iters=10)
        mla.update(cuda_ms=t_cuda, flash_mla_direct_ms=t_direct)
        rows.append(BenchRow.of("sparse_mla_prefill_64k_tflops", flops / t_cuda / 1e9, "TFLOP/s",
                                "FlashMLA called directly, same inputs (TFLOP/s)",
                                flops / t_direct / 1e9))
    detail["sparse_mla_64k"] = mla
    return rows


def _cuda_backend() -> tuple[KVOps | None, str]:
    host = PluginHost()
    try:
        reg = host.backends()
        av = reg.availability("cuda")
        return (reg.load("cuda"), "") if av.available else (None, av.reason)
    finally:
        host.close()


def _chunked_ref_mla(ref: KVOps, q: torch.Tensor, kv: torch.Tensor, ind: torch.Tensor, scale: float,
                     dv: int) -> torch.Tensor:
    # the reference gathers [rows, k, 576] fp32: 128 rows at a time keeps it near 600 MB
    return torch.cat([ref.sparse_mla(q[s:s + 128], kv, ind[s:s + 128], scale, dv)
                      for s in range(0, q.shape[0], 128)])


def _all_gather_views(pool: ShardedKVPool) -> AllGatherViews:
    """The all-gather strategy of ``pool`` (its send buffers are timed on their own)."""
    from cpkv.kv import AllGatherViews

    if not isinstance(pool.store.views, AllGatherViews):
        raise RuntimeError(f"expected an all_gather pool, got materialize={pool.store.views.mode}")
    return pool.store.views


def _all_gather_part(views: AllGatherViews, m: MaterializePlan, part: int) -> torch.Tensor:
    """One all-gather of this rank's pages of ``part`` of layer 0 (as a full view does)."""
    return views.group.all_gather_rows(views.send_buffer(0, m, part), m.max_send[part])


def _view_keys(pool: ShardedKVPool, kv: BatchKV) -> tuple[torch.Tensor, ...]:
    """Layer 0's view as the attention kernels take it (see :meth:`FullView.keys`)."""
    lat, k, scale = pool.materialize(0, kv).keys(torch.bfloat16)
    return (lat, k) if scale is None else (lat, k, scale)


@dataclass(frozen=True)
class MaterializeSpec:
    tokens: int
    dtype: str = "fp8"
    layers: int = 2


def materialize_rank(group: Any, spec: MaterializeSpec) -> dict[str, Any]:
    """One layer's materialization of a ``tokens``-token request on this CP group, in both modes
    (``all_gather``, ``p2p``), vs a raw ``all_gather_into_tensor`` of exactly the bytes each rank
    contributes; GPU time with every rank's interval started together (a one-element all-reduce
    after the spin), eager call time under ``eager``."""
    import torch.distributed as dist

    from cpkv.kv import ShardedKVPool
    from cpkv.ops import KV_OPS, OpTable
    from cpkv.planning import plan_batch

    host = PluginHost()
    ops = OpTable.resolve(host.backends(), ["triton", "torch"], KV_OPS, agree=group.agree_all)
    host.close()
    fmt = KVFormat.deepseek_v32(spec.dtype)
    pages = -(-spec.tokens // PAGE)
    plan = plan_batch([(0, spec.tokens)], group.size, PAGE)
    tiny = torch.zeros(1, device=group.device)

    def align() -> None:
        dist.all_reduce(tiny)

    out: dict[str, Any] = {"ops": dict(ops.chosen), "eager": {}}
    views = {}
    for mode in ("all_gather", "p2p"):
        pool = ShardedKVPool(fmt, spec.layers, group, ops, pages_per_rank=pages,
                             materialize=mode)
        kv = pool.prepare(plan, ["r"])
        for b in pool.store.kv:
            b.random_(0, 255, generator=torch.Generator(group.device).manual_seed(group.rank))
        torch.cuda.synchronize()
        out[f"mode_{mode}"] = pool.store.views.mode
        out[f"materialize_{mode}_ms"] = device_ms(partial(pool.materialize, 0, kv), iters=20,
                                                  align=align)
        out["eager"][mode] = cuda_ms(partial(pool.materialize, 0, kv), iters=20)
        # the view as the kernels take it (latent dequantized, index keys split): materialization
        # plus the consumers' pass, which reads the all-gather's buffer in place
        out[f"view_keys_{mode}_ms"] = device_ms(partial(_view_keys, pool, kv), iters=20,
                                                align=align)
        v = pool.materialize(0, kv)
        views[mode] = (v.latent(), v.index_k())
        if mode == "all_gather":
            m = kv.materialize
            ag = _all_gather_views(pool)
            send = ag.send_buffer(0, m, 0).contiguous()
            out["send_is_pool_slice"] = m.send_start[0] is not None
            out["send_buffer_ms"] = device_ms(partial(ag.send_buffer, 0, m, 0), iters=20)
            del ag  # holds the pool's buffers
            gathered = torch.empty(group.size * m.max_send[0] * PAGE, fmt.bytes_per_token,
                                   dtype=torch.uint8, device=group.device)
            # what the natural-order copy cost before views were read in place
            out["view_gather_ms"] = device_ms(partial(ops.page_gather, gathered, m.view_index),
                                              iters=20)
        del pool
        torch.cuda.empty_cache()
    out["p2p_view_equals_all_gather_view"] = all(
        torch.equal(a, b) for a, b in zip(views["all_gather"], views["p2p"], strict=True))
    recv = torch.empty(group.size * send.shape[0], *send.shape[1:], dtype=torch.uint8,
                       device=group.device)
    out["raw_all_gather_ms"] = device_ms(lambda: dist.all_gather_into_tensor(recv, send),
                                         iters=20, align=align)
    out["eager"]["raw_all_gather"] = cuda_ms(lambda: dist.all_gather_into_tensor(recv, send),
                                             iters=20)
    out["gathered_bytes"] = recv.numel()
    out["view_bytes"] = spec.tokens * fmt.bytes_per_token
    return out


def layer_flops(cfg: Any, n: int, indexer: bool = True) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of one dense layer over an ``n``-token prompt (causal, one
    request), by part: projections (q_a, q_b, the absorbed W_UK and W_UV, kv_a, the indexer's
    q/k/weights, o_proj), the indexer's logits over each token's causal keys, sparse MLA over
    min(position + 1, top-k) keys, and the dense MLP (gate, up, down). ``indexer=False``: a
    GLM-5 shared-indexer layer, which has no indexer weights and runs no indexer (it reuses its
    full layer's top-k): the indexer's projections and logits count zero."""
    h, heads, ql = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank
    lat, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    ih, idim, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    qk = cfg.qk_nope_head_dim + rope
    index_proj = ql * ih * idim + h * idim + h * ih if indexer else 0
    proj = (h * ql + ql * heads * qk + heads * cfg.qk_nope_head_dim * lat + h * (lat + rope)
            + index_proj + heads * lat * cfg.v_head_dim + heads * cfg.v_head_dim * h)
    keys = n * (n + 1) / 2  # sum over tokens of their causal key counts
    selected = sum(min(i + 1, k) for i in range(min(n, k))) + max(0, n - k) * k
    return {"projections": 2.0 * n * proj,
            "indexer": 2.0 * keys * ih * idim if indexer else 0.0,
            "sparse_mla": 2.0 * selected * heads * (lat + rope + lat),
            "mlp": 2.0 * n * 3 * h * cfg.intermediate_size}


def stack_flops(cfg: Any, n: int) -> dict[str, float]:
    """:func:`layer_flops` summed over ``cfg``'s decoder layers (all dense, as in the benches'
    stacks), each on its own indexer schedule (``cfg.layer_indexers``: DeepSeek-V3.2's layers
    all run their indexer; a GLM-5 ``shared`` layer counts none)."""
    per = {t: layer_flops(cfg, n, indexer=t == "full") for t in set(cfg.layer_indexers)}
    out = dict.fromkeys(next(iter(per.values())), 0.0)
    for t in cfg.layer_indexers:
        for part, f in per[t].items():
            out[part] += f
    return out


def kernel_profile(run: Callable[[], Any], top: int | None = 14) -> list[dict[str, Any]]:
    """Device time per kernel name over one call of ``run`` (torch.profiler), largest first:
    ``[{"total_ms"}, {"kernel", "ms", "calls"} x top]`` (``top=None``: every kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us:
            rows.append({"kernel": e.key[:90], "ms": us / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"total_ms": total}, *rows[:top]]


def op_sources(run: Callable[[], Any], frames: int = 3, top: int | None = 40,
               package: str = "cpkv") -> list[dict[str, Any]]:
    """Where the torch ops of one call of ``run`` come from: per (top-level torch op, the
    innermost ``frames`` Python frames of ``package`` under which it ran), the device time of the
    kernels it launched (its own and its sub-ops'; CPU time on a CPU) and its calls, largest
    first. The glue between a step's own kernels (casts, gathers, index arithmetic, norms) is
    many small torch ops whose kernel names (``elementwise_kernel<...>``) do not say which line
    launched them; this does. Kernels launched outside a torch op (Triton's) are not listed:
    :func:`kernel_profile` names them."""
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts, with_stack=True) as prof:
        run()
        if gpu:
            torch.cuda.synchronize()
    sums: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for e in prof.events():
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None
                                               and parent.name.startswith("aten::")):
            continue  # sub-ops are inside their top-level op's time
        where: list[str] = []
        while parent is not None and len(where) < frames:
            if package in parent.name:
                where.append(parent.name)
            parent = parent.cpu_parent
        if not where:
            continue
        us = e.device_time_total if gpu else e.cpu_time_total
        acc = sums.setdefault((e.name, tuple(where)), [0.0, 0])
        acc[0] += us
        acc[1] += 1
    ranked = sorted(((us, n, op, src) for (op, src), (us, n) in sums.items() if us),
                    reverse=True)
    return [{"op": op, "ms": us / 1e3, "calls": int(n), "source": list(src)}
            for us, n, op, src in ranked[:top]]


def host_timeline(run: Callable[[], Any]) -> dict[str, float]:
    """Where one call of ``run`` leaves the GPU idle (torch.profiler trace, ms): host time
    before its first kernel (per-batch host work the GPU waits for), after its last kernel,
    the kernels' busy time and the idle gaps between kernels (host launch work the GPU caught
    up with)."""
    import json
    import os
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile, record_function

    label = "cpkv.bench.timeline"
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # cycle here
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
                record_function(label):
            run()
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    span = [e for e in events if e.get("name") == label and e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"),
                     key=lambda e: e["ts"])
    if not span or not kernels:
        return {}
    start = min(e["ts"] for e in span)
    stop = max(e["ts"] + e["dur"] for e in span)
    busy = idle = 0.0
    end = kernels[0]["ts"]
    for e in kernels:
        idle += max(0.0, e["ts"] - end)
        end = max(end, e["ts"] + e["dur"])
        busy += e["dur"]
    return {"wall_ms": (stop - start) / 1e3,
            "host_before_first_kernel_ms": (kernels[0]["ts"] - start) / 1e3,
            "after_last_kernel_ms": (stop - end) / 1e3,
            "kernel_busy_ms": busy / 1e3, "gaps_between_kernels_ms": idle / 1e3}


@dataclass(frozen=True)
class PrefillSpec:
    model_dir: str
    tokens: tuple[int, ...]
    kv_dtype: str = "fp8"
    repeats: int = 11
    materialize: str = "auto"
    #: backend.preference of the runs (the settings' default: cuda, triton, torch)
    backends: tuple[str, ...] = ("cuda", "triton", "torch")
    #: one more prefill of this many tokens under torch.profiler (device time per kernel; 0: none)
    profile_tokens: int = 0
    #: runtime.indexer_dtype of the runs ("auto": the defaults; ``cpkv bench gpu``'s CP rows
    #: keep the bf16 indexer, its default-vs-bf16 rows run "auto")
    indexer_dtype: str = "bf16"


def prefill_rank(group: Any, spec: PrefillSpec) -> dict[str, Any]:
    """CP prefill of one prompt per size on this group: the median wall time of ``repeats``
    after the first (warm-up: compiles, allocator growth), each after a ``gc.collect()`` so a
    collection of the bench's own garbage does not land inside one of them, and a barrier so
    every rank starts at once."""
    import gc

    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    model = load_model(spec.model_dir, dtype=torch.bfloat16, device=group.device)
    settings = load_settings(cp={"size": group.size},
                             kv={"dtype": spec.kv_dtype, "page_size": PAGE, "pages_per_rank": 8192,
                                 "materialize": spec.materialize},
                             backend={"preference": list(spec.backends)},
                             runtime={"indexer_dtype": spec.indexer_dtype})
    session = PrefillSession(model, settings, group)
    out: dict[str, Any] = {"ops": dict(session.ops.chosen), "sizes": {},
                           "materialize": session.pool.store.views.mode,
                           "kv_dtype": str(session.settings.kv.dtype),
                           "indexer_dtype": session.settings.runtime.indexer_dtype}
    g = torch.Generator().manual_seed(0)
    for n in spec.tokens:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        times = []
        for r in range(spec.repeats):
            gc.collect()
            torch.cuda.synchronize()
            # every rank starts together, as a batch reaches an engine's ranks: without it a rank
            # whose collection ran shorter counts its wait for the others (20-30 ms at 64K)
            group.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            res = session.prefill([(f"p{n}-{r}", ids)])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            held = session.pool.footprint().bytes_held
            session.release(f"p{n}-{r}")
        out["sizes"][n] = {"seconds": statistics.median(times[1:] or times), "all": times,
                           "kv_bytes": held,
                           "replicated_bytes": held if group.size == 1 else None,
                           "phases": res.seconds,
                           "peak_gb": torch.cuda.max_memory_allocated(group.device) / 1e9}
        if n == spec.profile_tokens:
            out["sizes"][n]["kernels"] = kernel_profile(
                partial(session.prefill, [(f"p{n}-prof", ids)]))
            session.release(f"p{n}-prof")
            gc.collect()
            torch.cuda.synchronize()
            try:  # a diagnostic: a profiler that cannot trace does not end the bench
                out["sizes"][n]["timeline"] = host_timeline(
                    partial(session.prefill, [(f"p{n}-line", ids)]))
                session.release(f"p{n}-line")
            except Exception as exc:
                out["sizes"][n]["timeline"] = {"error": repr(exc)}
    out["layers"] = model.num_layers
    out["layer_flops"] = {n: layer_flops(model.config, n) for n in spec.tokens}
    return out


def decode_steps(dev: torch.device, model_dir: str, tokens: int, steps: int = 8,
                 backends: tuple[str, ...] = ("cuda", "triton", "torch"),
                 select_latent: bool | None = None,
                 layout: str = "part_major") -> dict[str, Any]:
    """Decode steps (one-token extends, as the decode rank runs them) after a ``tokens``-token
    prefill on one GPU, fp8 pool with ``layout`` pages (the decode rank's: part-major): the
    median wall time of ``steps`` steps after the first (each synchronized: a step's logits are
    read to pick the next token), the ops that ran, and a kernel profile of one step."""
    from cpkv.comm import CPGroup
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    model = load_model(model_dir, dtype=torch.bfloat16, device=dev)
    settings = load_settings(cp={"size": 1},
                             kv={"dtype": "fp8", "page_size": PAGE, "layout": layout,
                                 "pages_per_rank": tokens // PAGE + 64},
                             backend={"preference": list(backends)})
    session = PrefillSession(model, settings, CPGroup.single(dev))
    session.driver.select_latent = select_latent
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (tokens + steps + 1,), generator=g).tolist()
    session.prefill([("d", ids[:tokens])])
    times = []
    for i in range(steps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = session.prefill([("d", [ids[tokens + i]])])
        res.last_logits.argmax().item()  # the next token is read back, as a decode loop does
        times.append(time.perf_counter() - t)
    kernels = kernel_profile(partial(session.prefill, [("d", [ids[-1]])]))
    out = {"seconds": statistics.median(times[1:]), "all": times, "ops": dict(session.ops.chosen),
           "kernels": kernels}
    session.release("d")
    del session, model
    torch.cuda.empty_cache()
    return out


@dataclass(frozen=True)
class PrefetchSpec:
    model_dir: str
    prefix: int
    extend: int
    repeats: int = 3


def prefetch_rank(group: Any, spec: PrefetchSpec) -> dict[str, Any]:
    """An extend after a long cached prefix, with the next layer's prefix pages prefetched on a
    side stream or not: wall time of the extend batch (median of ``repeats``) both ways, and one
    layer's materialization of the whole view with and without the prefix part prefetched."""
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    model = load_model(spec.model_dir, dtype=torch.bfloat16, device=group.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (spec.prefix + spec.extend,),
                        generator=g).tolist()
    out: dict[str, Any] = {}
    runs: dict[bool, list[float]] = {False: [], True: []}
    # alternate the two settings so that warm-up and allocator state favour neither
    for prefetch in (False, True, False, True):
        settings = load_settings(cp={"size": group.size},
                                 kv={"dtype": "fp8", "page_size": PAGE, "pages_per_rank": 8192},
                                 backend={"preference": ["triton", "torch"]},
                                 runtime={"prefetch": prefetch})
        session = PrefillSession(model, settings, group)
        for r in range(spec.repeats):
            rid = f"{prefetch}-{r}"
            session.prefill([(rid, ids[: spec.prefix])])
            torch.cuda.synchronize()
            t = time.perf_counter()
            session.prefill([(rid, ids[spec.prefix:])])
            torch.cuda.synchronize()
            runs[prefetch].append(time.perf_counter() - t)
            session.release(rid)
        key = "extend_s_prefetch" if prefetch else "extend_s_no_prefetch"
        out[key] = statistics.median(runs[prefetch])
        out[key + "_all"] = list(runs[prefetch])
        if prefetch and "materialize_whole_ms" not in out:  # one layer's view: whole vs the
            # part left after a prefetch
            pool = session.pool
            session.prefill([("m", ids[: spec.prefix])])
            plan = session.driver.plan([("m", ids[spec.prefix:])])
            kv = pool.prepare(plan, ["m"])
            out["materialize_whole_ms"] = cuda_ms(partial(pool.materialize, 0, kv), iters=10)
            pf = pool.prefetch(0, kv)
            torch.cuda.synchronize()
            out["materialize_after_prefetch_ms"] = cuda_ms(partial(pool.materialize, 0, kv, pf),
                                                           iters=1, warmup=0)
            # the part that stays on the critical path, timed repeatedly on its own
            split = kv.materialize_split
            if split is None:
                raise RuntimeError("the extend batch has no whole prefix page to prefetch (or "
                                   f"the group has one rank): prefix={spec.prefix} tokens")
            out["new_part_all_gather_ms"] = cuda_ms(
                partial(_all_gather_part, _all_gather_views(pool), split, 1), iters=10)
            pool.abort(kv)
    return out


# -- cpkv bench gpu ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuBenchOptions:
    """What ``cpkv bench gpu`` measures (its options)."""

    #: prompt lengths of CP2 vs CP1 prefill
    sizes: tuple[int, ...] = (16384, 65536, 131072)
    layers: int = 2
    #: kernels and materialization only
    skip_prefill: bool = False
    #: cached prefix of the prefetch measurement (0 skips it)
    prefetch_prefix: int = 65536
    #: kv.materialize of the CP2 vs CP1 prefill runs
    materialize: str = "auto"
    #: backend.preference of the CP2 vs CP1 prefill runs
    backends: tuple[str, ...] = ("cuda", "triton", "torch")


def run(opts: GpuBenchOptions, progress: Callable[[str], None] = lambda s: None
        ) -> tuple[list[BenchRow], dict[str, Any]]:
    """``cpkv bench gpu`` on this host's GPUs (at least one): kernels against the ceilings,
    materialization against a raw all-gather (two GPUs), CP2 against CP1 prefill (CP1 rows with
    one GPU), the default numerics and decode steps at 64K, prefetch (two GPUs). Returns the
    rows and the detail."""
    dev = torch.device("cuda", 0)
    detail: dict[str, Any] = {}
    progress("ceilings")
    ceil = ceilings(dev)
    detail["ceilings"] = ceil
    progress(f"kernels (copy {ceil['copy_gbps']:.0f} GB/s, bf16 mm "
             f"{ceil['matmul_tflops']:.0f} TFLOP/s)")
    rows = kernel_rows(dev, ceil, detail)
    torch.cuda.empty_cache()
    ngpu = torch.cuda.device_count()
    if ngpu >= 2:
        progress("materialization on 2 GPUs")
        rows += _materialize_rows(detail)
    if ngpu >= 1 and not opts.skip_prefill:  # CP1 rows on one GPU, CP2 rows with two
        rows += _prefill_rows(dev, opts, ngpu, ceil, detail, progress)
    return rows, detail


def _materialize_rows(detail: dict[str, Any]) -> list[BenchRow]:
    from cpkv.runtime import run_ranks

    rows: list[BenchRow] = []
    for dtype in ("fp8", "bf16"):
        res = run_ranks(materialize_rank, 2, args=(MaterializeSpec(65536, dtype),),
                        backend="nccl", timeout_s=300)
        r0 = res[0].value
        detail[f"materialize_64k_{dtype}"] = [r.value for r in res]
        if dtype == "fp8":
            raw = max(r.value["raw_all_gather_ms"] for r in res)
            for mode, name in (("p2p", "materialize_64k_bw"),
                               ("all_gather", "materialize_64k_bw_all_gather")):
                if any(r.value[f"mode_{mode}"] != mode for r in res):
                    continue  # p2p fell back (the fallback event says why): no row
                mat = max(r.value[f"materialize_{mode}_ms"] for r in res)
                rows.append(BenchRow.of(name, r0["gathered_bytes"] / mat / 1e6, "GB/s",
                                        "raw all_gather_into_tensor of the same bytes",
                                        r0["gathered_bytes"] / raw / 1e6))
    return rows


def _prefill_rows(dev: torch.device, opts: GpuBenchOptions, ngpu: int, ceil: dict[str, float],
                  detail: dict[str, Any], progress: Callable[[str], None]) -> list[BenchRow]:
    """CP1 (and with two GPUs CP2) prefill at ``opts.sizes``; at 64K the default numerics and
    decode steps; with two GPUs prefetch."""
    import tempfile
    from pathlib import Path

    from cpkv.models import write_tiny_checkpoint
    from cpkv.runtime import run_ranks

    rows: list[BenchRow] = []
    lens = opts.sizes
    ckpt = Path(tempfile.mkdtemp()) / "deepseek-stack"
    progress(f"writing a {opts.layers}-layer DeepSeek-V3.2-sized stack")
    write_tiny_checkpoint(ckpt, seed=0, **v32_stack(opts.layers))
    spec = PrefillSpec(str(ckpt), lens, materialize=opts.materialize, backends=opts.backends,
                       profile_tokens=65536 if 65536 in lens else 0)
    per: dict[int, list[dict[str, Any]]] = {}
    for c in (1, 2)[:ngpu]:
        progress(f"CP{c} prefill at {lens}")
        res = run_ranks(prefill_rank, c, args=(spec,), backend="nccl", timeout_s=580)
        per[c] = [r.value for r in res]
    detail["prefill"] = {f"cp{c}": v for c, v in per.items()}
    for n in lens:
        t1 = per[1][0]["sizes"][n]["seconds"]
        if n == 65536:  # a whole prefill's layer FLOPs over its wall time: a lower bound of
            # the layers' rate (embedding, planning and the last logits count as time)
            one = per[1][0]
            flops = one["layers"] * sum(one["layer_flops"][n].values())
            rows.append(BenchRow.of("cp1_layer_64k_mfu", flops / t1 / 1e12, "TFLOP/s",
                                    "bf16 matmul ceiling (same run)", ceil["matmul_tflops"]))
        if 2 not in per:
            continue
        # a CP batch ends when its slowest rank does: per repeat the slower rank, then the
        # median (the ranks started each repeat together: a barrier)
        each = [max(ts) for ts in zip(*(r["sizes"][n]["all"] for r in per[2]), strict=True)]
        t2 = statistics.median(each[1:] or each)
        tag = f"{n // 1024}k"
        rows.append(BenchRow.of(f"cp2_vs_cp1_{tag}_speedup", n / t2, "tokens/s",
                                "CP1 prefill tokens/s (same run)", n / t1))
        b1 = per[1][0]["sizes"][n]["kv_bytes"]
        b2 = max(r["sizes"][n]["kv_bytes"] for r in per[2])
        rows.append(BenchRow.of(f"cp2_kv_bytes_per_rank_{tag}", b2, "bytes",
                                "CP1 (one rank holds every page)", b1))
    if 65536 in lens:
        rows += _default_numerics_rows(dev, spec, per[1][0], ceil, detail, progress)
    if ngpu >= 2 and opts.prefetch_prefix:
        rows.append(_prefetch_row(spec.model_dir, opts.prefetch_prefix, detail, progress))
    return rows


def _default_numerics_rows(dev: torch.device, spec: PrefillSpec, bf16: dict[str, Any],
                           ceil: dict[str, float], detail: dict[str, Any],
                           progress: Callable[[str], None]) -> list[BenchRow]:
    """CP1 64K prefill with the default numerics against ``bf16`` (the CP1 run of
    :func:`_prefill_rows`), and decode steps over a 64K-token request."""
    import dataclasses

    from cpkv.runtime import run_ranks

    rows: list[BenchRow] = []
    progress("CP1 64K prefill with the default numerics (kv.dtype and runtime.indexer_dtype "
             "'auto')")
    dflt = dataclasses.replace(spec, tokens=(65536,), kv_dtype="auto", indexer_dtype="auto",
                               profile_tokens=65536)
    one = run_ranks(prefill_rank, 1, args=(dflt,), backend="nccl", timeout_s=580)[0].value
    detail["prefill_cp1_64k_default"] = one
    flops = one["layers"] * sum(one["layer_flops"][65536].values())
    t_d, t_b = one["sizes"][65536]["seconds"], bf16["sizes"][65536]["seconds"]
    progress(f"defaults took a {one['kv_dtype']} pool and the {one['indexer_dtype']} indexer")
    if one["indexer_dtype"] == "fp8" and "fp8_matmul_tflops" in ceil:
        rows.append(BenchRow.of("cp1_layer_64k_fp8_mfu", flops / t_d / 1e12, "TFLOP/s",
                                "fp8 matmul ceiling (same run)", ceil["fp8_matmul_tflops"]))
    rows.append(BenchRow.of("cp1_64k_default_vs_bf16_speedup", 65536 / t_d, "tokens/s",
                            f"the bf16 indexer on the {bf16['kv_dtype']} pool "
                            f"(tokens/s, same run)", 65536 / t_b))
    progress("decode steps over a 64K-token request: cuda vs triton")
    ckpt = spec.model_dir
    dec = {name: decode_steps(dev, ckpt, 65536, backends=pref)
           for name, pref in (("cuda", ("cuda", "triton", "torch")),
                              ("triton", ("triton", "torch")))}
    # token-major pages: the picked rows dequantized into a copy, then FlashMLA's prefill
    # kernel; and the whole view dequantized (what a step did before either)
    dec["cuda_selected_rows"] = decode_steps(dev, ckpt, 65536, layout="token_major")
    dec["cuda_whole_view"] = decode_steps(dev, ckpt, 65536, select_latent=False,
                                          layout="token_major")
    detail["decode_64k"] = dec
    # GPU time (the profiled step's kernels): a step's wall time is ~10 ms of host work
    # in the driver either way, and its jitter drowns the kernels' difference
    gpu_ms = {k: v["kernels"][0]["total_ms"] for k, v in dec.items()}
    rows.append(BenchRow.of("decode_step_64k_speedup", 1e3 / gpu_ms["cuda"], "steps/s (GPU)",
                            "the Triton backend, same step (steps/s of GPU time)",
                            1e3 / gpu_ms["triton"]))
    return rows


def _prefetch_row(ckpt: str, prefix: int, detail: dict[str, Any],
                  progress: Callable[[str], None]) -> BenchRow:
    from cpkv.runtime import run_ranks

    progress(f"prefetch: {prefix}-token cached prefix + 4096-token extend")
    res = run_ranks(prefetch_rank, 2, args=(PrefetchSpec(ckpt, prefix, 4096),), backend="nccl",
                    timeout_s=580)
    vals = [r.value for r in res]
    detail["prefetch"] = vals
    off = max(v["extend_s_no_prefetch"] for v in vals)
    on = max(v["extend_s_prefetch"] for v in vals)
    return BenchRow.of(f"prefetch_{prefix // 1024}k_prefix_extend_speedup", 1 / on, "batches/s",
                       "the same extend without prefetch", 1 / off)
