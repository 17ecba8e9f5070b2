"""Prefill -> decode transfer benchmark: time to ready (prefill start -> the decode published the
request) with the layer pipeline against the request pipeline, and against the prefill alone,
in the same rank processes; on GPUs also the transfer's bandwidth against a raw device-to-device
copy of the same bytes measured in the same run.

World: C prefill ranks (CP group) + 1 decode rank, ``run_ranks`` (Gloo on CPU; NCCL with rank
r on ``cuda:r`` on GPUs). One request per batch, cache off, page-aligned zigzag plans. For each
prompt length: a warm-up request per mode (not timed), then ``repeats`` rounds of three requests
of the same tokens: ``alone`` (prefill only, nothing sent), ``request`` and ``layer``
(``transfer.pipeline``; the session's settings are switched between requests, the link stays).
Every request is released on both sides after it. Times are wall clock (``time.time()`` on one
host); per request the slowest prefill rank's view.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpkv.contracts import cdiv

from .report import BenchRow

if TYPE_CHECKING:
    import torch

    from cpkv.comm import CPGroup
    from cpkv.settings import Settings

__all__ = ["MODES", "TransferBenchSpec", "bench_rank", "bench_settings", "run", "run_label"]

MODES = ("alone", "request", "layer")
WARMUP_TOKENS = 512


@dataclass(frozen=True)
class TransferBenchSpec:
    """One benchmark run (picklable: it goes to every rank)."""

    model_dir: str
    tokens: tuple[int, ...]
    settings: Settings
    repeats: int = 1
    seed: int = 0


def bench_settings(cp: int, plugin: str, tokens: Sequence[int], page_size: int = 64,
                   timeout_s: float = 1800.0, kv_dtype: str = "bf16",
                   protocol: str = "tcp", stage: str = "auto") -> Settings:
    """Settings of the run: zigzag CP, a ``kv_dtype`` pool big enough for the longest prompt, no cache, the
    transfer plugin ``plugin`` (its bound long enough for a whole prefill: the decode waits for
    the offers, or the layer pipeline's Done, while the prefill runs; ``protocol`` and
    ``stage`` are Mooncake's ``transfer.mooncake.protocol`` and ``transfer.mooncake.stage``)."""
    from cpkv.settings import load_settings

    pages = cdiv(max(max(tokens), WARMUP_TOKENS), page_size)
    return load_settings(
        cp={"size": cp, "mode": "zigzag"},
        kv={"dtype": kv_dtype, "page_size": page_size, "pages_per_rank": cdiv(pages, cp) + 8},
        cache={"enabled": False}, backend={"preference": ["cuda", "triton", "torch"]},
        transfer={"name": plugin, "timeout_s": timeout_s,
                  "mooncake": {"protocol": protocol, "stage": stage}},
        runtime={"timeout_s": timeout_s})


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + n)
    return [rng.randrange(vocab) for _ in range(n)]


def _schedule(spec: TransferBenchSpec) -> list[tuple[str, int, str, bool]]:
    """(request id, tokens, mode, timed) in the order every rank serves them."""
    out = [(f"warm-{m}", WARMUP_TOKENS, m, False) for m in MODES]
    for n in spec.tokens:
        for r in range(spec.repeats):
            out += [(f"{m}-{n}-{r}", n, m, True) for m in MODES]
    return out


def _prefill_side(world: CPGroup, group: CPGroup, spec: TransferBenchSpec) -> dict[str, Any]:
    import torch

    from cpkv.disagg import select_transport
    from cpkv.models import load_model
    from cpkv.runtime.decode import greedy
    from cpkv.runtime.session import PrefillSession

    model = load_model(spec.model_dir, dtype=_dtype(group.device), device=group.device)
    base = spec.settings
    session = PrefillSession(model, base, group)
    session.connect(select_transport(base, world.agree_all))
    pipelined = {m: base.model_copy(update={"transfer": base.transfer.model_copy(
        update={"pipeline": m})}) for m in ("request", "layer")}
    rows: list[dict[str, Any]] = []
    for rid, n, mode, timed in _schedule(spec):
        toks = _prompt(n, model.config.vocab_size, spec.seed)
        group.barrier()
        if mode != "alone":
            session.settings = pipelined[mode]  # the link stays; prefill() reads the pipeline
        t0 = time.time()
        res = session.prefill([(rid, toks)], send={rid: True} if mode != "alone" else None)
        first = greedy(res.last_logits)[0]  # the logits are on the host: the prefill is done
        t1 = time.time()
        row: dict[str, Any] = {"rid": rid, "tokens": n, "mode": mode, "timed": timed,
                               "prefill_seconds": t1 - t0}
        if mode != "alone":
            sent = session.send(rid, meta={"first_token": first})
            row.update(ready_seconds=sent.ready_seconds, overlap_seconds=sent.overlap_seconds,
                       send_seconds=sent.send_seconds, bytes=sent.nbytes)
        else:
            row["ready_seconds"] = t1 - t0
        session.release(rid)
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    session.close()
    world.barrier()  # the decode rank measures the raw copy now, with this GPU idle
    world.barrier()
    return {"rows": rows}


def _raw_copy(nbytes: int) -> dict[str, float]:
    """A device-to-device copy of ``nbytes`` from ``cuda:0`` to ``cuda:1`` (both visible to this
    process), median GPU milliseconds and GB/s; empty without two GPUs."""
    import torch

    from .timing import device_ms

    if torch.cuda.device_count() < 2 or nbytes <= 0:
        return {}
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    with torch.cuda.device(1):
        ms = device_ms(lambda: dst.copy_(src, non_blocking=True))
    return {"bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6}


def _dtype(device: torch.device) -> torch.dtype:
    """The model's compute dtype: bfloat16 on GPUs (as `cpkv run --device cuda`), float32 on CPUs."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _decode_side(world: CPGroup, spec: TransferBenchSpec) -> dict[str, Any]:
    from cpkv.disagg import select_transport
    from cpkv.models import load_model
    from cpkv.runtime.decode import DecodeSession

    c = spec.settings.cp.size
    decode = DecodeSession(load_model(spec.model_dir, dtype=_dtype(world.device),
                                      device=world.device), spec.settings, world.device)
    decode.connect(select_transport(spec.settings, world.agree_all), cp_size=c)
    got: dict[str, int] = {}
    for rid, _, mode, _ in _schedule(spec):
        if mode == "alone":
            continue
        r = decode.receive()
        if r.manifest.request != rid or "first_token" not in r.meta:
            raise RuntimeError(f"received {r.manifest.request!r} ({dict(r.meta)}), expected {rid!r}")
        got[rid] = sum(r.bytes_per_rank)
        decode.release(rid)
    world.barrier()
    raw = {n: _raw_copy(max(v for k, v in got.items() if k.endswith(f"-{n}-0")))
           for n in spec.tokens}
    world.barrier()
    return {"received": got, "raw_copy": raw}


def bench_rank(world: CPGroup, spec: TransferBenchSpec) -> dict[str, Any]:
    """One process of the benchmark: a prefill rank (0..C-1) or the decode rank (C)."""
    import torch.distributed as dist

    from cpkv.comm import CPGroup

    s = spec.settings
    c = s.cp.size
    cp_pg = dist.new_group(list(range(c)), timeout=timedelta(seconds=world.timeout_s))
    if world.rank < c:
        group = CPGroup.from_process_group(cp_pg, timeout_s=world.timeout_s,
                                           device=world.device)
        return _prefill_side(world, group, spec)
    return _decode_side(world, spec)


def run_label(plugin: str, protocol: str = "tcp") -> str:
    """The rows' name of a run: the plugin, with Mooncake's protocol (``mooncake_nvlink_intra``)."""
    return f"{plugin}_{protocol}" if plugin == "mooncake" else plugin


def run(model_dir: str | Path, settings: Settings, *, tokens: Sequence[int], repeats: int = 1,
        gpus: bool = False, progress: Callable[[str], None] = lambda s: None,
        label: str | None = None) -> tuple[list[BenchRow], dict[str, Any]]:
    """Run :func:`bench_rank` on ``cp.size + 1`` processes (NCCL on ``cuda:r`` with ``gpus``).
    Returns the rows named ``transfer_<label>_<tokens>_...`` (``label`` default: the plugin;
    per prompt length: ready time layer vs request, layer vs the prefill alone, the prefill's
    time while its layers are sent vs alone; on GPUs the transfer's GB/s vs a raw copy of the
    same bytes) and the detail."""
    from cpkv.runtime import run_ranks

    c = settings.cp.size
    plugin = settings.transfer.name
    name = label or plugin
    spec = TransferBenchSpec(str(model_dir), tuple(tokens), settings, repeats)
    progress(f"CP{c} -> 1 decode, {plugin}: {list(tokens)} tokens, {repeats} round(s) of "
             f"{', '.join(MODES)}")
    res = [r.value for r in run_ranks(bench_rank, c + 1, args=(spec,),
                                      backend="nccl" if gpus else "gloo",
                                      timeout_s=settings.runtime.timeout_s)]
    per_rank = [r["rows"] for r in res[:c]]
    dec = res[c]
    rows: list[BenchRow] = []
    detail: dict[str, Any] = {"plugin": plugin, "label": name, "cp": c, "tokens": list(tokens),
                              "repeats": repeats, "requests": [], "raw_copy": dec["raw_copy"],
                              "settings": {"kv_dtype": str(settings.kv.dtype),
                                           "page_size": settings.kv.page_size,
                                           "max_inflight_mb": settings.transfer.max_inflight_mb,
                                           # the plugin's own table, as set (its defaults
                                           # apply to the rest)
                                           plugin: settings.transfer.tables().get(plugin, {})}}
    for i, row in enumerate(per_rank[0]):  # the slowest rank's view of each request
        merged = dict(row)
        for key in ("prefill_seconds", "ready_seconds", "send_seconds"):
            if key in row:
                merged[key] = max(r[i][key] for r in per_rank)
        if "overlap_seconds" in row:  # the rank whose sends were hidden least decides
            merged["overlap_seconds"] = min(r[i]["overlap_seconds"] for r in per_rank)
            merged["send_seconds_per_rank"] = [r[i]["send_seconds"] for r in per_rank]
            merged["overlap_seconds_per_rank"] = [r[i]["overlap_seconds"] for r in per_rank]
        if "bytes" in row:
            merged["bytes"] = sum(r[i]["bytes"] for r in per_rank)
        detail["requests"].append(merged)
    for r in detail["requests"]:  # what the transfer adds after the prefill ended
        r["exposed_seconds"] = max(0.0, r["ready_seconds"] - r["prefill_seconds"])
    timed = [r for r in detail["requests"] if r["timed"]]
    for n in tokens:
        def med_of(key: str, mode: str, n: int = n) -> float:
            return statistics.median(r[key] for r in timed if r["tokens"] == n and r["mode"] == mode)

        med = {m: med_of("ready_seconds", m) for m in MODES}
        exposed = {m: med_of("exposed_seconds", m) for m in ("request", "layer")}
        k = f"{n // 1024}k" if n % 1024 == 0 else str(n)
        rows.append(BenchRow.of(f"transfer_{name}_{k}_ready_layer_vs_request", med["layer"], "s",
                                "ready with the request pipeline, same run", med["request"]))
        rows.append(BenchRow.of(f"transfer_{name}_{k}_ready_layer_vs_prefill", med["layer"], "s",
                                "prefill alone (nothing sent), same run", med["alone"]))
        # ready - prefill of the same request: the prefills' run-to-run noise cancels
        rows.append(BenchRow.of(f"transfer_{name}_{k}_exposed_layer_vs_request",
                                max(exposed["layer"], 1e-6), "s after the prefill",
                                "the request pipeline's, same run", max(exposed["request"], 1e-6)))
        # the prefill's own time while its layers are sent (the layer pipeline) vs alone
        prefill = {m: med_of("prefill_seconds", m) for m in ("alone", "layer")}
        rows.append(BenchRow.of(f"transfer_{name}_{k}_prefill_while_sending", prefill["layer"],
                                "s", "prefill alone (nothing sent), same run", prefill["alone"]))
        req = [r for r in timed if r["tokens"] == n and r["mode"] == "request"]
        gbps = statistics.median(r["bytes"] / r["send_seconds"] / 1e9 for r in req)
        raw = dec["raw_copy"].get(n) or {}
        if raw:
            rows.append(BenchRow.of(f"transfer_{name}_{k}_gbps", gbps, "GB/s",
                                    f"raw cuda:0 -> cuda:1 copy of the same "
                                    f"{raw['bytes'] / 1e6:.0f} MB", raw["gbps"]))
        detail[f"median_{k}"] = {**med, "exposed": exposed, "request_send_gbps": gbps,
                                 "prefill": prefill,
                                 "layer_overlap_seconds": statistics.median(
                                     r["overlap_seconds"] for r in timed
                                     if r["tokens"] == n and r["mode"] == "layer")}
    return rows, detail
