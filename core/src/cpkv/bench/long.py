"""Long prompts on one GPU (``cpkv bench long``): a 256K-1M-token prompt prefilled in chunks, as
an engine does, on the 2-layer ``v32-attention`` stack (CP1), and the fp8 indexer's top-k
agreement with the bf16 one.

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
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from cpkv.comm import note_progress

from .gpu import kernel_profile, layer_flops

__all__ = ["LongSpec", "RecallSpec", "fp8_recall_rank", "long_rank", "topk_share"]

#: kernel-name fragments of the top-k's kernels and of the indexer's (Triton)
_TOPK_KERNELS = ("_topk_", "_mask_kernel")
_INDEXER_KERNELS = ("_indexer_kernel", "_indexer_few_rows_kernel")


@dataclass(frozen=True)
class LongSpec:
    """One ``long_rank`` call: a prompt of each of ``tokens`` prefilled in chunks of each of
    ``chunks``; the chunk ending at ``profile`` = (tokens, chunk) prompt's end is profiled."""

    model_dir: str
    tokens: tuple[int, ...]
    chunks: tuple[int, ...]
    kv_dtype: str = "fp8"
    indexer_dtype: str = "bf16"
    #: runtime.logits_budget_mb: a number, or None for the settings' default ("auto")
    budget_mb: int | None = None
    profile: tuple[int, int] | None = None


def topk_share(kernels: list[dict[str, Any]]) -> dict[str, float]:
    """From a kernel profile (``name``/``ms`` rows): the top-k kernels' and the indexer kernel's
    device milliseconds."""
    topk = sum(r["ms"] for r in kernels if "kernel" in r and any(s in r["kernel"]
                                                                  for s in _TOPK_KERNELS))
    idx = sum(r["ms"] for r in kernels if "kernel" in r and any(s in r["kernel"]
                                                                 for s in _INDEXER_KERNELS))
    return {"topk_ms": topk, "indexer_ms": idx}


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

    dtype = torch.bfloat16 if group.device.type == "cuda" else torch.float32
    model = load_model(spec.model_dir, dtype=dtype, device=group.device)
    session = _session(model, group, max(spec.tokens), spec.kv_dtype, spec.indexer_dtype,
                       spec.budget_mb)
    out: dict[str, Any] = {"ops": dict(session.ops.chosen), "layers": model.num_layers,
                           "budget_mb": session.logits_budget_mb,
                           "budget_auto": session.logits_budget_auto, "runs": {}}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    # warm-up: every kernel specialisation the timed chunks use (compiles; the top-k's
    # long-row path starts at 192K keys: a 256K-token prompt in the smallest chunks)
    c0 = min(spec.chunks)
    warm = torch.randint(0, vocab, (max(4 * c0, min(max(spec.tokens), 262144)),), generator=g)
    for s in range(0, warm.numel(), c0):
        session.prefill([("warm", warm[s:s + c0])])
    session.release("warm")
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
            flops = model.num_layers * sum(layer_flops(model.config, n).values())
            out["runs"][f"{n}/{c}"] = {
                "tokens": n, "chunk": c, "seconds": seconds, "chunk_seconds": per_chunk,
                "layer_tflops": flops / seconds / 1e12,
                "peak_gb": _peak_gb(group.device),
                "kv_bytes": session.pool.bytes_held()}
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
    """``fp8_recall_rank``: prompts of each of ``tokens`` through a bf16-query and an
    fp8-query indexer session on checkpoint ``model_dir``."""

    model_dir: str
    tokens: tuple[int, ...]
    label: str = "v32-attention"
    #: runtime.logits_budget_mb of both sessions (None: the settings' default)
    budget_mb: int | None = None


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


def fp8_recall_rank(group: Any, spec: RecallSpec) -> dict[str, Any]:
    """Per prompt length and layer: the fp8 indexer's (fp8 queries and keys, per-token
    scales) top-k recall of the bf16 indexer's (bf16 queries, the fp8 pool's keys) over the
    rows holding more than k keys, and the last-token logits' relative difference."""
    from cpkv.models import load_model

    model = load_model(spec.model_dir, dtype=torch.bfloat16, device=group.device)
    k = model.config.index_topk
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"checkpoint": spec.label, "k": k, "tokens": {}}
    for n in spec.tokens:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
        caps, last = {}, {}
        for dt in ("bf16", "fp8"):
            session = _session(model, group, n, "fp8", dt, spec.budget_mb)
            res = session.prefill([("r", ids)], capture_topk=True)
            caps[dt], last[dt] = list(res.topk.indices), res.last_logits[0].float()
            session.release("r")
            del session, res  # the captured scores and the session's buffers
            gc.collect()
            torch.cuda.empty_cache()
        layers = []
        for a, b in zip(caps["bf16"], caps["fp8"], strict=True):
            mean, low, rows = _recall(a, b, k)
            layers.append({"recall_mean": mean, "recall_min": low, "rows": rows})
        diff = (last["fp8"] - last["bf16"]).abs().max() / last["bf16"].abs().max()
        out["tokens"][n] = {"layers": layers, "last_logits_rel_diff": float(diff)}
    return out


def write_hf_checkpoint(path: str, **config: Any) -> str:
    """A randomly initialised DeepSeek-V3.2 checkpoint written by transformers
    (``DeepseekV32ForCausalLM(config).save_pretrained``, transformers' own initialisation),
    built on the GPU; ``config``: config.json keys. Needs transformers."""
    import transformers

    from cpkv.models.tiny import tiny_config

    hf = tiny_config(**config).hf_dict()
    hf.pop("architectures", None)
    cfg = transformers.DeepseekV32Config(**hf)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.DeepseekV32ForCausalLM(cfg)
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


def long_rows(res: dict[str, Any], matmul_tflops: float, device_gb: float,
              fixed: dict[str, Any] | None = None) -> list[Any]:
    """The bench rows of a :func:`long_rank` result: per prompt length ``long_<n>_mfu`` (64K
    chunks, or the smallest chunk size run) and ``long_<n>_c<chunk>_mfu`` for the others,
    against the same run's bf16 matmul ceiling; ``long_<n>_topk_share`` of the profiled chunk
    (top-k kernels' device time over the indexer kernel's); the peak memory of the longest
    prompt against the device's memory, also for the ``fixed``-budget run."""
    from .report import BenchRow

    rows = []
    chunks = sorted({r["chunk"] for r in res["runs"].values()})
    for r in res["runs"].values():
        suffix = "" if r["chunk"] == chunks[0] else f"_c{_tag(r['chunk'])}"
        rows.append(BenchRow.of(f"long_{_tag(r['tokens'])}{suffix}_mfu", r["layer_tflops"],
                                "TFLOP/s", "bf16 matmul ceiling (same run)", matmul_tflops))
    p = res.get("profile")
    if p and p["indexer_ms"] > 0:
        rows.append(BenchRow.of(f"long_{_tag(p['tokens'])}_topk_share", p["topk_ms"], "ms",
                                f"indexer kernel time of the same chunk ({p['rows']} rows)",
                                p["indexer_ms"]))
    longest = max(res["runs"].values(), key=lambda r: (r["tokens"], -r["chunk"]))
    rows.append(BenchRow.of(f"long_{_tag(longest['tokens'])}_peak_gb", longest["peak_gb"], "GB",
                            "device memory", device_gb))
    if fixed:
        for r in fixed["runs"].values():
            rows.append(BenchRow.of(
                f"long_{_tag(r['tokens'])}_budget{fixed['budget_mb']}_peak_gb", r["peak_gb"],
                "GB", "device memory", device_gb))
    return rows


def recall_rows(res: dict[str, Any]) -> list[Any]:
    """``indexer_fp8_recall_<label>_<n>``: the fp8 indexer's worst layer's mean recall of the
    bf16 indexer's top-k set, per prompt length."""
    from .report import BenchRow

    label = res["checkpoint"].replace("-", "_")
    return [BenchRow.of(f"indexer_fp8_recall_{label}_{_tag(int(n))}",
                        min(x["recall_mean"] for x in v["layers"]), "recall",
                        "the bf16 indexer's top-k set (same run)", 1.0)
            for n, v in res["tokens"].items()]
