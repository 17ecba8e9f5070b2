"""Decode steps on one GPU (``cpkv bench decode``): the decode rank's lean step
(:class:`~cpkv.runtime.decoder.LeanDecoder`) replayed from CUDA graphs against the same step run
eagerly, for batches of requests at several context lengths, on the 2-layer ``v32-attention``
stack with an fp8 part-major pool (the decode rank's).

Per (batch, context, graphs or eager): the median wall time of a step as a decode loop sees it
(inputs staged, the step run, the next tokens read back) and the median GPU time of the same step
(:func:`~cpkv.bench.timing.device_ms`: a spin kernel queued ahead hides the host's work), their
ratio (how host-bound the step is), and tokens per second. The requests' KV is written directly
(random rows through the pool's own write, no prefill): a step's cost does not depend on where
its keys came from, and a 64 x 128K-token prefill would take minutes.

Speculative decoding (the same stack with an MTP layer that agrees with it, ``draft="agree"``):
per (batch, context, k drafts) the tokens per second of ``DecodeWorker.speculate`` with graphs
and eagerly, and whether both gave plain greedy decoding's tokens.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from .timing import device_ms

__all__ = ["DecodeBenchSpec", "decode_bench_rank", "decode_rows", "filled_worker",
           "probe_filled_worker", "step_bytes"]

T = TypeVar("T")


@dataclass(frozen=True)
class DecodeBenchSpec:
    """``decode_bench_rank``: every batch size at every context length, graphs and eager."""

    model_dir: str
    batches: tuple[int, ...] = (1, 8, 64)
    contexts: tuple[int, ...] = (4096, 65536, 131072)
    steps: int = 30
    page_size: int = 64
    #: the stack with an agreeing MTP layer (None: no speculation runs)
    mtp_model_dir: str | None = None
    mtp_shapes: tuple[tuple[int, int], ...] = ((1, 65536), (8, 65536))
    mtp_drafts: tuple[int, ...] = (1, 2)
    mtp_tokens: int = 64


def _fill(worker: Any, rids: list[Hashable], context: int, seed: int) -> None:
    """``context`` tokens of random KV for each request, written into pages of its own."""
    pool, model = worker.pool, worker.session.model
    s, dev = pool.fmt.page_size, pool.group.device
    cfg = model.config
    g = torch.Generator(device=dev).manual_seed(seed)
    npages = -(-context // s)
    for rid in rids:
        slots = pool.pages.allocate_pages(0, npages, "bench pages")
        pool.pages.extend(rid, [(0, x) for x in slots], context)
        base = torch.tensor(slots, dtype=torch.int64, device=dev)[:, None] * s
        rows = (base + torch.arange(s, device=dev)).reshape(-1)[:context]
        for start in range(0, context, 65536):
            r = rows[start:start + 65536]
            for layer in range(model.kv_layers):
                lat = torch.randn(r.numel(), cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                  generator=g, device=dev, dtype=model.dtype)
                idx = torch.randn(r.numel(), cfg.index_head_dim, generator=g, device=dev,
                                  dtype=model.dtype)
                pool.store.write_rows(layer, r, lat, idx)


def _measure(worker: Any, rids: list[Hashable], steps: int) -> dict[str, Any]:
    cur: list[tuple[Hashable, int]] = [(rid, 1) for rid in rids]

    def one() -> None:
        nonlocal cur
        nxt = worker.step(cur)
        cur = list(zip(rids, nxt, strict=True))

    for _ in range(3):  # compiles, captures
        one()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        one()
        walls.append((time.perf_counter() - t) * 1e3)
    wall = statistics.median(walls)
    gpu = device_ms(one, warmup=1, iters=steps, lead_ms=max(5.0, 3 * wall))
    dec = worker.decoder
    return {"wall_ms": wall, "gpu_ms": gpu, "wall_over_gpu": wall / gpu,
            "tokens_per_s": len(rids) / wall * 1e3,
            "graph": bool(dec is not None and dec.last is not None and dec.last.graph),
            "shape": None if dec is None or dec.last is None else
            [dec.last.shape.batch, dec.last.shape.pages]}


def filled_worker(model: Any, spec: DecodeBenchSpec, b: int, ctx: int, graphs: bool,
            dev: torch.device) -> tuple[Any, list[Hashable]]:
    """A decode worker holding ``b`` requests of ``ctx`` tokens of KV each."""
    from cpkv.runtime.decode import DecodeWorker
    from cpkv.settings import load_settings

    pages = b * (-(-(ctx + 4 * max(spec.steps, spec.mtp_tokens)) // spec.page_size) + 1) + 8
    settings = load_settings(cp={"size": 1},
                             kv={"dtype": "fp8", "page_size": spec.page_size,
                                 "pages_per_rank": pages},
                             decode={"cuda_graphs": graphs,
                                     "max_batch": max((*spec.batches, 1))})
    worker = DecodeWorker(model, settings, dev)
    rids: list[Hashable] = [f"r{i}" for i in range(b)]
    _fill(worker, rids, ctx, seed=b + ctx)
    return worker, rids


def _probe_rank(group: Any, ckpt: str, b: int, ctx: int,
                probe: Callable[[Any, list[Hashable]], T]) -> T:
    from cpkv.models import load_model

    model = load_model(ckpt, dtype=torch.bfloat16, device=group.device)
    worker, rids = filled_worker(model, DecodeBenchSpec(ckpt, (b,), (ctx,)), b, ctx, False,
                                 group.device)
    return probe(worker, rids)


def probe_filled_worker(probe: Callable[[Any, list[Hashable]], T], b: int, ctx: int,
                        layers: int = 2) -> T:
    """``probe(worker, rids)`` in one GPU rank process, on an eager decode worker holding ``b``
    requests of ``ctx`` tokens each (the ``layers``-layer ``v32-attention`` stack, fp8 pool):
    the benchmark scripts' way to look inside a decode step. ``probe`` must pickle (a top-level
    function) and return something that does."""
    from cpkv.models import write_tiny_checkpoint
    from cpkv.runtime import run_ranks

    from .gpu import v32_stack

    ckpt = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "stack", seed=0,
                                 **v32_stack(layers, ctx + 4096))
    res = run_ranks(_probe_rank, 1, args=(str(ckpt), b, ctx, probe), backend="nccl",
                    timeout_s=900)
    value: T = res[0].value
    return value


def _done() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def decode_bench_rank(group: Any, spec: DecodeBenchSpec) -> dict[str, Any]:
    """The runs of ``spec`` on this (one-GPU) group; see the module docstring."""
    from cpkv.models import load_model

    dev = group.device
    gpu = dev.type == "cuda"
    before = torch.cuda.memory_allocated(dev) if gpu else 0
    model = load_model(spec.model_dir, dtype=torch.bfloat16, device=dev)
    cfg = model.config
    out: dict[str, Any] = {"layers": model.num_layers, "runs": {}, "speculative": {},
                           "index_topk": cfg.index_topk}
    if gpu:  # the bytes a step must read and the copy bandwidth to read them at
        # the weights a step reads: all but the embedding table (b rows of it)
        out["weight_bytes"] = (torch.cuda.memory_allocated(dev) - before
                               - cfg.vocab_size * cfg.hidden_size * 2)
        src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_(0, 255)
        dst = torch.empty_like(src)
        out["copy_gbps"] = 2 * (1 << 30) / device_ms(lambda: dst.copy_(src)) / 1e6
        del src, dst
    for ctx in spec.contexts:
        for b in spec.batches:
            for graphs in (True, False):
                worker, rids = filled_worker(model, spec, b, ctx, graphs, dev)
                run = _measure(worker, rids, spec.steps)
                run["ops"] = dict(worker.session.ops.chosen)
                out["runs"][f"{b}x{ctx}/{'graphs' if graphs else 'eager'}"] = run
                del worker
                _done()
    del model
    _done()
    if spec.mtp_model_dir is not None:
        out["speculative"] = _speculation(spec, dev)
    return out


def _speculation(spec: DecodeBenchSpec, dev: torch.device) -> dict[str, Any]:
    """Tokens/s of speculative decoding with graphs and eagerly, and plain greedy's tokens."""
    from cpkv.models import load_model

    assert spec.mtp_model_dir is not None
    model = load_model(spec.mtp_model_dir, dtype=torch.bfloat16, device=dev, mtp=True)
    res: dict[str, Any] = {}
    n = spec.mtp_tokens
    for b, ctx in spec.mtp_shapes:
        worker, rids = filled_worker(model, spec, b, ctx, True, dev)
        plain = worker.generate([(rid, 1) for rid in rids], n)
        del worker
        _done()
        for k in spec.mtp_drafts:
            for graphs in (True, False):
                worker, rids = filled_worker(model, spec, b, ctx, graphs, dev)
                first = [(rid, 1, 1) for rid in rids]
                worker.speculate(first, 8, draft_tokens=k)  # compiles, captures
                for rid in rids:  # the same requests again, from their context
                    worker.pool.pages.truncate(rid, ctx)
                t = time.perf_counter()  # (speculate reads its tokens back: synced at both ends)
                tokens, stats = worker.speculate(first, n, draft_tokens=k)
                wall = time.perf_counter() - t
                res[f"{b}x{ctx}/k{k}/{'graphs' if graphs else 'eager'}"] = {
                    "seconds": wall, "tokens_per_s": b * (n - 1) / wall,
                    "equal_plain": tokens == plain, **stats.as_dict()}
                del worker
                _done()
    return res


def _tag(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def step_bytes(res: dict[str, Any], b: int, ctx: int) -> float:
    """The fewest bytes a decode step of ``b`` requests at ``ctx`` tokens reads: the weights
    once, and per request and layer its index-K (132 B a token: the indexer scores every key)
    and its top-k latent rows (656 B each)."""
    per_layer = ctx * 132 + min(res["index_topk"], ctx) * 656
    return float(res["weight_bytes"] + b * res["layers"] * per_layer)


def decode_rows(res: dict[str, Any]) -> list[Any]:
    """Per (batch, context): ``decode_{b}x{ctx}_wall_over_gpu`` (the graph step's wall time over
    its GPU time), ``decode_{b}x{ctx}_gpu_vs_bytes`` (its GPU time over reading
    :func:`step_bytes` once at the run's copy bandwidth; GPU runs) and
    ``decode_{b}x{ctx}_graph_speedup`` (tokens/s with graphs over eager); per speculative run
    ``decode_mtp_k{k}_{b}x{ctx}_graph_speedup``."""
    from .report import BenchRow

    rows = []
    for key, run in res["runs"].items():
        shape, mode = key.split("/")
        if mode != "graphs":
            continue
        b, ctx = (int(x) for x in shape.split("x"))
        name = f"decode_{b}x{_tag(ctx)}"
        rows.append(BenchRow.of(f"{name}_wall_over_gpu", run["wall_ms"], "ms",
                                "GPU time of the same step (same run)", run["gpu_ms"]))
        if "copy_gbps" in res:
            rows.append(BenchRow.of(f"{name}_gpu_vs_bytes", run["gpu_ms"], "ms",
                                    "reading its bytes once at the same run's copy bandwidth "
                                    "(ms)", step_bytes(res, b, ctx) / res["copy_gbps"] / 1e6))
        eager = res["runs"].get(f"{shape}/eager")
        if eager is not None:
            rows.append(BenchRow.of(f"{name}_graph_speedup", run["tokens_per_s"], "tok/s",
                                    "the same step run eagerly (tok/s)", eager["tokens_per_s"]))
    for key, run in res.get("speculative", {}).items():
        shape, k, mode = key.split("/")
        eager = res["speculative"].get(f"{shape}/{k}/eager")
        if mode != "graphs" or eager is None:
            continue
        b, ctx = (int(x) for x in shape.split("x"))
        rows.append(BenchRow.of(f"decode_mtp_{k}_{b}x{_tag(ctx)}_graph_speedup",
                                run["tokens_per_s"], "tok/s",
                                "speculative decoding run eagerly (tok/s)", eager["tokens_per_s"]))
    return rows
