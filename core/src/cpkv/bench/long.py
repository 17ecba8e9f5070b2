"""Long prompts on one GPU (``cpkv bench long``): a 256K-1M-token prompt prefilled in chunks, as
an engine does, on the 2-layer ``v32-attention`` stack (CP1; ``--preset glm5-attention``: GLM-5's
attention, one full and one shared-indexer layer, its rows named ``glm5_...``), and the fp8
indexer's top-k agreement with the bf16 one.

What a run measures, per (prompt length, chunk size): wall seconds (per chunk and in all), the
layers' FLOPs over that time against the bf16 matmul ceiling of the same run (MFU), the peak
device memory, the last-token logits (equal across chunkings is the contract: chunking changes
neither logits nor top-k choices), the logits budget the session took; one chunk is profiled
(torch.profiler: the top-k kernels' device time against the indexer kernel's). A CP8 rank at 1M
tokens computes 128K query rows against up to 1M keys, the shape of this run's last chunks:
its time to first token is projected from the CP1 run (``seconds / 8``; the per-layer
all-gather of 1M tokens' fp8 KV, ~0.8 GB, adds ~3 ms a layer over NVLink and is left out).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from cpkv.comm import note_progress

from .gpu import kernel_profile, stack_flops

#: seconds the fp8 matmul runs back to back before its sustained rate is timed: a prompt's
#: prefill runs for seconds at the card's power limit, a 10-call ceiling at its boost clock
#: (docs/perf.md "Clock at the power limit"); each ``long_<n>_fp8_mfu`` row gets a
#: ``_sustained`` twin against it
SUSTAINED_S = 3.0

if TYPE_CHECKING:
    from cpkv.runtime.launch import ProgressSink

    from .report import BenchRow

__all__ = ["PRESETS", "HFLogitsSpec", "LongBenchOptions", "LongSpec", "RecallSpec",
           "fp8_recall_rank", "hf_logits_rank", "long_rank", "row_prefix", "run", "summary_line",
           "topk_share"]

#: the stacks ``cpkv bench long --preset`` runs (:data:`cpkv.models.tiny.PRESETS`)
PRESETS = ("v32-attention", "glm5-attention")

#: kernel-name fragments of the top-k's kernels and of the indexer's (Triton); the fused
#: indexer top-k's filter (the indexer with the candidate filter in its epilogue) and its
#: top-k-only kernels (the sample's floor, the select, the flagged rows' exact pass)
_TOPK_KERNELS = ("_topk_", "_mask_kernel")
_INDEXER_KERNELS = ("_indexer_kernel", "_indexer_few_rows_kernel")
_FUSED_FILTER = "_fused_filter_kernel"
_FUSED_TOPK_KERNELS = ("_sample_floor_kernel", "_fused_select_kernel", "_fused_exact_kernel")


@dataclass(frozen=True)
class LongSpec:
    """One ``long_rank`` call: a prompt of each of ``tokens`` prefilled in chunks of each of
    ``chunks``; the chunk ending at ``profile`` = (tokens, chunk) prompt's end is profiled."""

    model_dir: str
    tokens: tuple[int, ...]
    chunks: tuple[int, ...]
    #: kv.dtype / runtime.indexer_dtype of the session ("auto": the defaults, resolved for
    #: the GPU: fp8 and DeepSeek's fp8 indexer where it has fp8 tensor cores)
    kv_dtype: str = "auto"
    indexer_dtype: str = "auto"
    #: runtime.logits_budget_mb: a number, or None for the settings' default ("auto")
    budget_mb: int | None = None
    profile: tuple[int, int] | None = None


def topk_share(kernels: list[dict[str, Any]]) -> dict[str, float]:
    """From a kernel profile (``name``/``ms`` rows): the top-k kernels' and the indexer kernel's
    device milliseconds. A profile with the fused indexer top-k's filter counts the filter as
    the indexer and the plain indexer kernels as top-k work (in a fused chunk they compute the
    sample's logits); the filter's epilogue itself is inside the indexer's time
    (benchmarks/indexer_topk_gpu.py measures it against the plain indexer)."""
    named = [r for r in kernels if "kernel" in r]

    def ms(parts: tuple[str, ...]) -> float:
        return sum(r["ms"] for r in named if any(s in r["kernel"] for s in parts))

    if any(_FUSED_FILTER in r["kernel"] for r in named):
        return {"topk_ms": ms(_TOPK_KERNELS + _FUSED_TOPK_KERNELS + _INDEXER_KERNELS),
                "indexer_ms": ms((_FUSED_FILTER,))}
    return {"topk_ms": ms(_TOPK_KERNELS), "indexer_ms": ms(_INDEXER_KERNELS)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0


def _prefill_into(session: Any, batch: list[Any], held: list[Any]) -> None:
    held.append(session.prefill(batch))


def _profile_last_chunk(session: Any, ids: torch.Tensor, c: int) -> dict[str, Any]:
    """The prompt ``ids`` in chunks of ``c``, the last one under torch.profiler: its top-k and
    indexer kernels' device time."""
    n = ids.numel()
    last = ((n - 1) // c) * c
    for s in range(0, last, c):
        session.prefill([("prof", ids[s:s + c])])
    held: list[Any] = []
    kern = kernel_profile(partial(_prefill_into, session, [("prof", ids[last:])], held), top=None)
    session.release("prof")
    return {"tokens": n, "chunk": c, "rows": n - last, "keys": n, **topk_share(kern),
            "kernels": kern[1:17]}


def _session(model: Any, group: Any, tokens: int, kv_dtype: str, indexer_dtype: str,
             budget_mb: int | None) -> Any:
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    runtime: dict[str, Any] = {"indexer_dtype": indexer_dtype}
    if budget_mb is not None:
        runtime["logits_budget_mb"] = budget_mb
    settings = load_settings(cp={"size": group.size},
                             kv={"dtype": kv_dtype, "page_size": 64,
                                 "pages_per_rank": tokens // 64 + 64},
                             runtime=runtime)
    return PrefillSession(model, settings, group)


def long_rank(group: Any, spec: LongSpec) -> dict[str, Any]:
    """The chunked prefills of ``spec`` on this (one-rank) group; see the module docstring."""
    from cpkv.models import load_model
    from cpkv.runtime.warmup import warm_up

    dtype = torch.bfloat16 if group.device.type == "cuda" else torch.float32
    model = load_model(spec.model_dir, dtype=dtype, device=group.device)
    session = _session(model, group, max(spec.tokens), spec.kv_dtype, spec.indexer_dtype,
                       spec.budget_mb)
    out: dict[str, Any] = {"ops": dict(session.ops.chosen), "layers": model.num_layers,
                           "kv_dtype": str(session.settings.kv.dtype),
                           "indexer_dtype": session.settings.runtime.indexer_dtype,
                           "budget_mb": session.logits_budget_mb,
                           "budget_auto": session.logits_budget_auto, "runs": {}}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    # warm-up: every kernel variant the timed chunks meet, compiled before they are timed
    # (runtime.warmup.warm_up over the longest prompt in each chunk size: the row groups the
    # logits budget cuts, and so the launches' shapes, change with the key count; warming to
    # 256K only left compile stalls of 1-2.5 s in the 384K-704K chunks of a GLM-5 1M run)
    out["warmup_seconds"] = {c: warm_up(session, max(spec.tokens), c).seconds
                             for c in sorted(set(spec.chunks))}
    for n in spec.tokens:
        ids = torch.randint(0, vocab, (n,), generator=g)
        logits = {}
        for c in spec.chunks:
            rid = f"p{n}-{c}"
            gc.collect()
            _sync(group.device)
            if group.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(group.device)
            per_chunk: list[float] = []
            start = time.perf_counter()
            res = None
            for s in range(0, n, c):
                t = time.perf_counter()
                res = session.prefill([(rid, ids[s:s + c])])
                _sync(group.device)
                per_chunk.append(time.perf_counter() - t)
                # per chunk: the parent's progress lines (and the launcher's bound on silence)
                note_progress(f"prefill of {n:,} tokens in chunks of {c:,}", min(n, s + c), n)
            seconds = time.perf_counter() - start
            if res is not None:
                logits[c] = res.last_logits[0].float().cpu()
            # every layer on its own schedule: a GLM-5 shared layer runs no indexer
            flops = stack_flops(model.config, n)
            out["runs"][f"{n}/{c}"] = {
                "tokens": n, "chunk": c, "seconds": seconds, "chunk_seconds": per_chunk,
                "flops": flops, "layer_tflops": sum(flops.values()) / seconds / 1e12,
                "peak_gb": _peak_gb(group.device),
                "kv_bytes": session.pool.footprint().bytes_held}
            session.release(rid)
            if spec.profile == (n, c) and group.device.type == "cuda":  # untimed, profiled
                out["profile"] = _profile_last_chunk(session, ids, c)
        ref = next(iter(logits.values()), None)
        out.setdefault("logits_equal", {})[n] = (
            None if ref is None or len(logits) < 2 else
            all(torch.equal(ref, v) for v in logits.values()))
    return out


@dataclass(frozen=True)
class RecallSpec:
    """``fp8_recall_rank``: prompts of each of ``tokens`` on checkpoint ``model_dir``; the
    indexer's inputs of every layer captured once, then scored both ways."""

    model_dir: str
    tokens: tuple[int, ...]
    label: str = "v32-attention"
    #: runtime.logits_budget_mb of the capturing session (None: the settings' default)
    budget_mb: int | None = None
    #: rows scored per indexer call (bounds the [rows, keys] fp32 logits)
    rows_per_call: int = 4096


def _recall(a: torch.Tensor, b: torch.Tensor, k: int) -> tuple[float, float, int]:
    """Mean and minimum over rows holding more than k keys of |A & B| / k (A, B: the two
    top-k sets of a row, -1 padded), and how many rows that is."""
    full = (a >= 0).sum(1) == k
    a, b = a[full].long(), b[full].long()
    if a.shape[0] == 0:
        return 1.0, 1.0, 0
    hits = torch.zeros(a.shape[0], device=a.device)
    sb = b.sort(1).values
    for s in range(0, a.shape[0], 4096):  # rows in pieces: [rows, k] searches
        pos = torch.searchsorted(sb[s:s + 4096], a[s:s + 4096]).clamp_max(k - 1)
        hits[s:s + 4096] = (sb[s:s + 4096].gather(1, pos) == a[s:s + 4096]).sum(1).float()
    r = hits / k
    return float(r.mean()), float(r.min()), int(a.shape[0])


def _captured_inputs(model: Any, session: Any, ids: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(index_q, index_w, index_k) of every layer that runs an indexer (a GLM-5 shared layer
    runs none: its top-k is its full layer's), as the model made them while ``session``
    prefilled ``ids`` (one request, one batch)."""
    got: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    plain = model.attention_inputs

    def spy(*a: Any, **k: Any) -> Any:
        out = plain(*a, **k)
        if out.index_q is not None and out.index_w is not None and out.index_k is not None:
            got.append((out.index_q.clone(), out.index_w.clone(), out.index_k.clone()))
        return out

    model.attention_inputs = spy
    try:
        session.prefill([("r", ids)])
    finally:
        del model.attention_inputs
    session.release("r")
    return got


def _layer_choices(ops: Any, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, topk: int,
                   step: int) -> dict[str, Any]:
    """One layer's indexer both ways on the same inputs (causal rows: row i sees keys
    [0, i + 1)): bf16 (transformers' definition: q . k in the model dtype, fp32 logits) and
    DeepSeek's fp8 (both rotated, ue8m0 e4m3, scales folded). Overlap of the two top-k sets
    per row with more than ``topk`` keys, and the near-tie evidence: for every key the fp8
    choice swapped in, how far below the bf16 k-th logit its bf16 logit is, relative to the
    k-th; and the fp8 logits' error at the bf16 k-th key, on the same scale."""
    from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q

    n = q.shape[0]
    dev = q.device
    k8, ks8 = quantize_fp8(hadamard_rotate(k), None, "ue8m0")
    recall_sum, recall_min, rows = 0.0, 1.0, 0
    gaps: list[torch.Tensor] = []
    errs: list[torch.Tensor] = []
    for s in range(0, n, step):
        e = min(n, s + step)
        start = torch.zeros(e - s, dtype=torch.int64, device=dev)
        end = torch.arange(s + 1, e + 1, dtype=torch.int64, device=dev)
        cols = int(e)  # keys [0, e) suffice for rows < e
        lb = ops.indexer_logits(q[s:e], w[s:e], k[:cols], None, start, end)
        tb = ops.topk(lb, topk, start, end)
        q8, w8 = quantize_index_q(hadamard_rotate(q[s:e]), w[s:e])
        l8 = ops.indexer_logits(q8, w8, k8[:cols], ks8[:cols], start, end)
        t8 = ops.topk(l8, topk, start, end)
        mean, low, r = _recall(tb, t8, topk)
        if r:
            recall_sum += mean * r
            recall_min = min(recall_min, low)
            rows += r
            full = (tb >= 0).sum(1) == topk
            lbf, l8f, tbf, t8f = lb[full], l8[full], tb[full].long(), t8[full].long()
            picked = lbf.gather(1, tbf)
            kth, pos = picked.min(1, keepdim=True)  # the bf16 k-th logit of each row, its slot
            kth = kth.squeeze(1)
            member = torch.zeros_like(lbf, dtype=torch.bool).scatter_(1, tbf, True)
            swapped_in = ~member.gather(1, t8f)  # fp8 picks outside the bf16 set
            v = lbf.gather(1, t8f)
            gap = (kth[:, None] - v) / kth.abs().clamp_min(1e-30)[:, None]
            gaps.append(gap[swapped_in].float())
            at = tbf.gather(1, pos)  # the bf16 k-th key of each row
            errs.append(((l8f.gather(1, at) - lbf.gather(1, at)).abs().squeeze(1)
                         / kth.abs().clamp_min(1e-30)).float())
        del lb, l8, tb, t8
    gap = torch.cat(gaps) if gaps else torch.zeros(0, device=dev)
    err = torch.cat(errs) if errs else torch.zeros(0, device=dev)

    def q_(t: torch.Tensor, p: float) -> float | None:
        return float(t.quantile(p)) if t.numel() else None

    sub = err[torch.randperm(err.numel(), device=dev)[:1 << 20]] if err.numel() else err
    gsub = gap[torch.randperm(gap.numel(), device=dev)[:1 << 20]] if gap.numel() else gap
    return {"recall_mean": recall_sum / rows if rows else 1.0, "recall_min": recall_min,
            "rows": rows, "swapped_keys": int(gap.numel()),
            "swap_gap_rel_median": q_(gsub, 0.5), "swap_gap_rel_p99": q_(gsub, 0.99),
            "fp8_err_rel_at_kth_median": q_(sub, 0.5), "fp8_err_rel_at_kth_p99": q_(sub, 0.99)}


def fp8_recall_rank(group: Any, spec: RecallSpec) -> dict[str, Any]:
    """Per prompt length and layer, on the SAME layer inputs (no compounding across layers):
    the inputs of every layer's indexer are captured from one bf16 prefill (bf16 pool, bf16
    indexer: the residual stream transformers computes), then each layer's top-k is chosen
    by the bf16 indexer and by DeepSeek's fp8 indexer (:func:`_layer_choices`; the layers that
    run an indexer: GLM-5's full layers). Also the
    last-token logits of full prefills with the bf16 pool + bf16 indexer, the fp8 pool + bf16
    indexer and the defaults (fp8 pool + fp8 indexer where the GPU has fp8 tensor cores),
    their relative difference to the first's."""
    from cpkv.models import load_model

    model = load_model(spec.model_dir, dtype=torch.bfloat16, device=group.device)
    k = model.config.index_topk
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"checkpoint": spec.label, "k": k, "same_layer_inputs": True,
                           "tokens": {}}
    for n in spec.tokens:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
        session = _session(model, group, n, "bf16", "bf16", spec.budget_mb)
        caps = _captured_inputs(model, session, ids)
        ops = session.ops
        layers = [_layer_choices(ops, q, w, kk, k, spec.rows_per_call) for q, w, kk in caps]
        del caps, session
        gc.collect()
        torch.cuda.empty_cache()
        last = {}
        for label, kv, idx in (("bf16", "bf16", "bf16"), ("fp8_pool_bf16_indexer", "fp8", "bf16"),
                               ("default", "auto", "auto")):
            session = _session(model, group, n, kv, idx, spec.budget_mb)
            last[label] = session.prefill([("l", ids)]).last_logits[0].float()
            if label == "default":
                out["default"] = {"kv_dtype": str(session.settings.kv.dtype),
                                  "indexer_dtype": session.settings.runtime.indexer_dtype}
            session.release("l")
            del session
            gc.collect()
            torch.cuda.empty_cache()
        ref = last["bf16"]
        out["tokens"][n] = {
            "layers": layers,
            "last_logits_rel_diff": {lab: float((v - ref).abs().max() / ref.abs().max())
                                     for lab, v in last.items() if lab != "bf16"},
            "argmax_equal": {lab: bool(v.argmax() == ref.argmax()) for lab, v in last.items()
                             if lab != "bf16"}}
    return out


@dataclass(frozen=True)
class HFLogitsSpec:
    """``hf_logits_rank``: last-token logits of a ``tokens``-token prompt on the checkpoint
    written by transformers at ``model_dir``, cpkv (three numerics) vs transformers (fp32)."""

    model_dir: str
    tokens: int = 4096


def hf_logits_rank(group: Any, spec: HFLogitsSpec) -> dict[str, Any]:
    """transformers' own fp32 forward pass (eager attention, its sparse mask) against cpkv's
    bf16 prefill with the bf16 pool + bf16 indexer, the fp8 pool + bf16 indexer and the
    defaults: max relative error of the last-token logits and whether the argmax agrees
    (transformers' class of the checkpoint's family: ``DeepseekV32ForCausalLM``,
    ``GlmMoeDsaForCausalLM``)."""
    import transformers

    from cpkv.models import load_model
    from cpkv.models.loader import read_config

    g = torch.Generator().manual_seed(2)
    hf = getattr(transformers, read_config(spec.model_dir).architecture).from_pretrained(
        spec.model_dir, attn_implementation="eager", torch_dtype=torch.float32).to(group.device)
    hf.eval()
    ids = torch.randint(0, hf.config.vocab_size, (spec.tokens,), generator=g)
    with torch.no_grad():
        want = hf(ids[None].to(group.device)).logits[0, -1].float()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    model = load_model(spec.model_dir, dtype=torch.bfloat16, device=group.device)
    res: dict[str, Any] = {"tokens": spec.tokens, "reference": "transformers fp32, eager"}
    for label, kv, idx in (("bf16", "bf16", "bf16"), ("fp8_pool_bf16_indexer", "fp8", "bf16"),
                           ("default", "auto", "auto")):
        session = _session(model, group, spec.tokens, kv, idx, None)
        got = session.prefill([("h", ids)]).last_logits[0].float()
        res[label] = {"max_rel_err": float((got - want).abs().max() / want.abs().max()),
                      "argmax_equal": bool(got.argmax() == want.argmax()),
                      "kv_dtype": str(session.settings.kv.dtype),
                      "indexer_dtype": session.settings.runtime.indexer_dtype}
        session.release("h")
        del session
    return res


def write_hf_checkpoint(path: str, device: str = "cuda", **config: Any) -> str:
    """A randomly initialised DeepSeek-V3.2 or GLM-5 checkpoint (``config``'s ``model_type``)
    written by transformers (``DeepseekV32ForCausalLM(config).save_pretrained`` /
    ``GlmMoeDsaForCausalLM``, transformers' own initialisation), built on ``device``;
    ``config``: config.json keys. Needs transformers."""
    import transformers

    from cpkv.models.tiny import tiny_config

    ours = tiny_config(**config)
    hf = ours.hf_dict()
    hf.pop("architectures", None)
    cls = getattr(transformers, ours.architecture)
    cfg = getattr(transformers, ours.architecture.replace("ForCausalLM", "Config"))(**hf)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    model = model.bfloat16()
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def _tag(n: int) -> str:
    """1048576 -> "1m", 524288 -> "512k", 300 -> "300"."""
    if n % (1 << 20) == 0 and n:
        return f"{n >> 20}m"
    return f"{n >> 10}k" if n % 1024 == 0 and n else str(n)


def row_prefix(preset: str) -> str:
    """What the rows of a ``preset`` stack begin with: nothing for ``v32-attention`` (the rows
    as they always were), ``glm5_`` for ``glm5-attention`` (``glm5_long_1m_mfu``, ...)."""
    return "" if preset == "v32-attention" else preset.split("-")[0] + "_"


def long_rows(res: dict[str, Any], ceil: dict[str, float], device_gb: float,
              fixed: dict[str, Any] | None = None,
              bf16: dict[str, Any] | None = None, prefix: str = "") -> list[Any]:
    """The bench rows of a :func:`long_rank` result ``res`` (the defaults) and, where the
    defaults took the fp8 indexer, ``bf16`` (the same prompts with the bf16 indexer, same run);
    every name begins with ``prefix`` (:func:`row_prefix`).

    Per prompt length (64K chunks, or the smallest chunk size run; ``_c<chunk>`` for the
    others): ``long_<n>_mfu`` against the same run's bf16 matmul ceiling for the bf16-indexer
    runs (``res`` itself when its indexer is bf16), ``long_<n>_fp8_mfu`` against the fp8 matmul
    ceiling for fp8-indexer runs, and ``long_<n>_default_vs_bf16_speedup`` (tokens/s of the
    defaults over the bf16 run's: bf16 seconds / default seconds). ``long_<n>_topk_share`` of
    the profiled chunk (top-k kernels' device time over the indexer kernel's); the peak memory
    of the longest prompt against the device's memory, also for the ``fixed``-budget run."""
    from .report import BenchRow

    rows = []

    def mfu(run: dict[str, Any], fp8: bool) -> None:
        chunks = sorted({r["chunk"] for r in run["runs"].values()})
        for r in run["runs"].values():
            suffix = "" if r["chunk"] == chunks[0] else f"_c{_tag(r['chunk'])}"
            if fp8:
                name = f"{prefix}long_{_tag(r['tokens'])}{suffix}_fp8_mfu"
                rows.append(BenchRow.of(name, r["layer_tflops"], "TFLOP/s",
                                        "fp8 matmul ceiling (same run)",
                                        ceil["fp8_matmul_tflops"]))
                if "fp8_matmul_sustained_tflops" in ceil:
                    rows.append(BenchRow.of(f"{name}_sustained", r["layer_tflops"], "TFLOP/s",
                                            "fp8 matmul ceiling at the power limit (same run)",
                                            ceil["fp8_matmul_sustained_tflops"]))
            else:
                rows.append(BenchRow.of(f"{prefix}long_{_tag(r['tokens'])}{suffix}_mfu",
                                        r["layer_tflops"], "TFLOP/s",
                                        "bf16 matmul ceiling (same run)", ceil["matmul_tflops"]))

    fp8 = res.get("indexer_dtype") == "fp8" and "fp8_matmul_tflops" in ceil
    mfu(res, fp8)
    if bf16 is not None:
        mfu(bf16, False)
        for key, r in bf16["runs"].items():
            d = res["runs"].get(key)
            if d is None:
                continue
            suffix = "" if r["chunk"] == min(x["chunk"] for x in bf16["runs"].values()) \
                else f"_c{_tag(r['chunk'])}"
            rows.append(BenchRow.of(
                f"{prefix}long_{_tag(r['tokens'])}{suffix}_default_vs_bf16_speedup",
                r["tokens"] / d["seconds"], "tokens/s",
                f"the bf16 indexer, same prompt and pool (tokens/s; {r['seconds']:.1f} s vs "
                f"{d['seconds']:.1f} s)", r["tokens"] / r["seconds"]))
    p = res.get("profile")
    if p and p["indexer_ms"] > 0:
        rows.append(BenchRow.of(f"{prefix}long_{_tag(p['tokens'])}_topk_share", p["topk_ms"], "ms",
                                f"indexer kernel time of the same chunk ({p['rows']} rows)",
                                p["indexer_ms"]))
    longest = max(res["runs"].values(), key=lambda r: (r["tokens"], -r["chunk"]))
    rows.append(BenchRow.of(f"{prefix}long_{_tag(longest['tokens'])}_peak_gb", longest["peak_gb"], "GB",
                            "device memory", device_gb))
    if fixed:
        for r in fixed["runs"].values():
            rows.append(BenchRow.of(
                f"long_{_tag(r['tokens'])}_budget{fixed['budget_mb']}_peak_gb", r["peak_gb"],
                "GB", "device memory", device_gb))
    return rows


def recall_rows(res: dict[str, Any]) -> list[Any]:
    """``indexer_fp8_overlap_<label>_<n>``: per prompt length, the worst layer's mean overlap
    of DeepSeek's fp8 indexer's top-k set with the bf16 indexer's, on the same layer inputs."""
    from .report import BenchRow

    label = res["checkpoint"].replace("-", "_")
    return [BenchRow.of(f"indexer_fp8_overlap_{label}_{_tag(int(n))}",
                        min(x["recall_mean"] for x in v["layers"]), "overlap",
                        "the bf16 indexer's top-k set on the same layer inputs (same run)", 1.0)
            for n, v in res["tokens"].items()]


# -- cpkv bench long --------------------------------------------------------------------------


@dataclass(frozen=True)
class LongBenchOptions:
    """What ``cpkv bench long`` measures (its options)."""

    #: prompt lengths (empty: the recall only)
    tokens: tuple[int, ...] = (262144, 524288, 1048576)
    #: chunk sizes each prompt is prefilled in
    chunks: tuple[int, ...] = (65536, 131072)
    layers: int = 2
    #: runtime.logits_budget_mb of the runs (None: the settings' default)
    budget_mb: int | None = None
    #: also the longest prompt in the smallest chunks at this fixed budget (0 skips it)
    fixed_budget_mb: int = 512
    #: prompt lengths of the fp8-vs-bf16 indexer top-k overlap (empty skips it)
    recall_tokens: tuple[int, ...] = (4096, 16384, 65536, 131072)
    #: the overlap also on a checkpoint written by transformers
    hf: bool = True
    #: prompt length of the last-token logits against transformers (0 skips it)
    hf_tokens: int = 4096
    #: where the defaults take the fp8 indexer, the prompts again with the bf16 one
    bf16_compare: bool = True
    #: the stack (:data:`PRESETS`): its rows named by :func:`row_prefix`
    preset: str = "v32-attention"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r}: cpkv bench long runs {', '.join(PRESETS)}")


def run(opts: LongBenchOptions, progress: Callable[[str], None] = lambda s: None,
        on_progress: ProgressSink | None = None) -> tuple[list[BenchRow], dict[str, Any], str]:
    """``cpkv bench long`` on GPU 0: returns the rows, the detail and a summary line (empty
    without ``opts.tokens``). ``on_progress``: the long runs' per-chunk progress notes."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from cpkv.models import write_tiny_checkpoint
    from cpkv.runtime import run_ranks

    from .gpu import attention_stack, ceilings

    dev = torch.device("cuda", 0)
    lens, sizes, rlens = opts.tokens, opts.chunks, opts.recall_tokens
    ceil = ceilings(dev, sustained_s=SUSTAINED_S)
    device_gb = torch.cuda.get_device_properties(dev).total_memory / 1e9
    prefix = row_prefix(opts.preset)
    detail: dict[str, Any] = {"ceilings": ceil, "device_gb": device_gb, "preset": opts.preset}
    tmp = Path(tempfile.mkdtemp())
    stack = attention_stack(opts.preset, opts.layers, max((*lens, *rlens), default=0))
    ckpt = str(write_tiny_checkpoint(tmp / "stack", seed=0, **stack))
    rows: list[BenchRow] = []
    res: dict[str, Any] = {}
    if lens:
        spec = LongSpec(ckpt, lens, sizes, budget_mb=opts.budget_mb,
                        profile=(524288, min(sizes)) if 524288 in lens else None)
        progress(f"{opts.layers}-layer {opts.preset} stack: {lens} tokens in chunks of {sizes}, the default "
                 f"numerics")
        res = run_ranks(long_rank, 1, args=(spec,), backend="nccl", timeout_s=3600,
                        on_progress=on_progress)[0].value
        detail["long"] = res
        progress(f"defaults took a {res['kv_dtype']} pool and the {res['indexer_dtype']} indexer")
        bf16 = None
        if res["indexer_dtype"] != "bf16" and opts.bf16_compare:  # same prompts, bf16 indexer
            progress(f"{lens} tokens in chunks of {min(sizes)} with the bf16 indexer on the same "
                     f"{res['kv_dtype']} pool")
            bspec = dataclasses.replace(spec, chunks=(min(sizes),), kv_dtype=res["kv_dtype"],
                                        indexer_dtype="bf16", profile=None)
            bf16 = run_ranks(long_rank, 1, args=(bspec,), backend="nccl", timeout_s=3600,
                             on_progress=on_progress)[0].value
            detail["long_bf16_indexer"] = bf16
        fixed = None
        if opts.fixed_budget_mb:
            progress(f"{max(lens)} tokens in chunks of {min(sizes)} at a "
                     f"{opts.fixed_budget_mb} MB logits budget")
            fspec = dataclasses.replace(spec, tokens=(max(lens),), chunks=(min(sizes),),
                                        budget_mb=opts.fixed_budget_mb, profile=None)
            fixed = run_ranks(long_rank, 1, args=(fspec,), backend="nccl",
                              timeout_s=3600)[0].value
            detail["fixed_budget"] = fixed
        rows += long_rows(res, ceil, device_gb, fixed, bf16, prefix)
    if rlens:
        ckpts = [(opts.preset, ckpt)]
        if opts.hf:
            progress("writing the stack with transformers")
            ckpts.append((f"{prefix}hf", write_hf_checkpoint(str(tmp / "hf"), **stack)))
        for label, path in ckpts:
            progress(f"fp8 vs bf16 indexer top-k on the same layer inputs, {label}, at {rlens}")
            rec = run_ranks(fp8_recall_rank, 1,
                            args=(RecallSpec(path, rlens, label, opts.budget_mb),),
                            backend="nccl", timeout_s=3600)[0].value
            detail[f"fp8_overlap_{label}"] = rec
            rows += recall_rows(rec)
        if opts.hf and opts.hf_tokens:
            progress(f"last-token logits vs transformers at {opts.hf_tokens} tokens")
            detail["vs_transformers"] = run_ranks(
                hf_logits_rank, 1, args=(HFLogitsSpec(ckpts[1][1], opts.hf_tokens),),
                backend="nccl", timeout_s=1800)[0].value
    return rows, detail, summary_line(res, sizes, opts.preset) if res else ""


def summary_line(res: dict[str, Any], chunks: tuple[int, ...],
                 preset: str = "v32-attention") -> str:
    """One line of a long run's result (:func:`long_rank`'s): the stack, the defaults it took,
    its logits budget, whether the chunkings agreed, the projected CP8 time to first token."""
    longest = max(res["runs"].values(), key=lambda r: (r["tokens"], r["chunk"] == min(chunks)))
    auto = " (auto: from the free device memory)" if res["budget_auto"] else ""
    return (f"{preset}: defaults: {res['kv_dtype']} pool, {res['indexer_dtype']} indexer; "
            f"logits budget {res['budget_mb']} MB{auto}; logits equal across chunkings: "
            f"{res.get('logits_equal')}; CP8 {longest['tokens']}-token time to first "
            f"token projected {longest['seconds'] / 8:.2f} s "
            f"({longest['tokens'] // 8} rows a rank)")
