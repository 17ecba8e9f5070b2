"""The MTP draft layer's benchmark (``cpkv bench mtp``): GPUs (NCCL) or CPUs (Gloo), small sizes
work on either.

1. **Draft prefill memory, local vs full embedding** (rule 32): CP2 prefill of one prompt with
   the draft layer, once with the plan (each rank embeds its local draft tokens padded to
   ``max_rank_len``) and once with the plan withheld (every rank embeds the whole prompt: the
   ``draft_plan_missing`` fallback). Per rank: bytes of the draft embedding, and on GPUs the
   peak memory of the draft layer over what was allocated when it started
   (``torch.cuda.max_memory_allocated``). Rows: local / full, the largest rank's.
2. **Decode tokens per second, speculative vs plain greedy**, one decode process on the same
   checkpoint (an agreeing draft: ``draft="agree"``): prefill the prompts, then ``decode_tokens``
   greedy tokens per request plainly and speculatively (``k`` drafts per step), timed after a
   warm-up, with the tokens checked equal.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .report import BenchRow

if TYPE_CHECKING:
    from cpkv.comm import CPGroup

__all__ = ["DecodeSpec", "MemorySpec", "agree_config", "decode_rank", "memory_rank", "rows"]


@dataclass(frozen=True)
class MemorySpec:
    model_dir: str
    tokens: int
    kv_dtype: str = "fp8"
    backends: tuple[str, ...] = ("cuda", "triton", "torch")
    page_size: int = 64


def _load(model_dir: str, device: torch.device) -> Any:
    from cpkv.models import load_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_model(model_dir, dtype=dtype, device=device, mtp=True)


def memory_rank(group: CPGroup, spec: MemorySpec) -> dict[str, Any]:
    """One rank of the CP draft-prefill memory measurement (see the module docstring)."""
    from cpkv.contracts import cdiv
    from cpkv.fallback import recording
    from cpkv.runtime.prefill import BATCH_PLAN
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    dev = group.device
    cuda = dev.type == "cuda"
    model = _load(spec.model_dir, dev)
    settings = load_settings(
        cp={"size": group.size},
        kv={"dtype": spec.kv_dtype, "page_size": spec.page_size,
            "pages_per_rank": cdiv(spec.tokens, spec.page_size) + 8},
        backend={"preference": list(spec.backends)}, cache={"enabled": False})
    session = PrefillSession(model, settings, group)
    driver = session.driver
    real_embed = model.draft_embed
    now: dict[str, Any] = {}

    def embed(ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = real_embed(ids)
        now["embed_rows"] = ids.shape[0]
        now["embed_bytes"] = out.numel() * out.element_size()
        return out

    @contextmanager
    def timed(part: str) -> Iterator[None]:
        """The driver's region hook: times (and measures the memory of) the draft layer."""
        if part != "draft":
            yield
            return
        if cuda:
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(dev)
            now["peak_bytes"] = torch.cuda.max_memory_allocated(dev) - base
        now["seconds"] = time.perf_counter() - t

    driver.sync_free_region = timed
    model.draft_embed = embed
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (spec.tokens,), generator=g).tolist()
    out: dict[str, Any] = {"rank": group.rank, "ops": dict(session.ops.chosen)}
    for r, how in enumerate(("local", "full", "local", "full")):  # the first two warm up
        gc.collect()
        now.clear()
        with recording() as rec:
            res = session.prefill([(f"{how}{r}", ids)],
                                  draft_plan=BATCH_PLAN if how == "local" else None)
        session.release(f"{how}{r}")
        assert res.draft_embedding == how
        out[how] = dict(now) | {"fallbacks": [e.reason.value for e in rec.events],
                                "max_rank_len": res.plan.max_rank_len}
    return out


@dataclass(frozen=True)
class DecodeSpec:
    model_dir: str
    prompt_lens: tuple[int, ...]
    decode_tokens: int
    draft_tokens: int = 1
    kv_dtype: str = "fp8"
    backends: tuple[str, ...] = ("cuda", "triton", "torch")
    repeats: int = 3


def decode_rank(group: CPGroup, spec: DecodeSpec) -> dict[str, Any]:
    """One decode process: plain vs speculative greedy decoding of the same prompts (the
    median of ``repeats`` timed runs each, after a warm-up of each); fails if the tokens differ."""
    from cpkv.contracts import cdiv
    from cpkv.fallback import recording
    from cpkv.runtime.decode import generate, greedy
    from cpkv.runtime.session import PrefillSession
    from cpkv.runtime.speculative import speculative_generate
    from cpkv.settings import load_settings

    dev = group.device
    cuda = dev.type == "cuda"
    model = _load(spec.model_dir, dev)
    need = sum(cdiv(n + spec.decode_tokens + spec.draft_tokens + 1, 64) for n in spec.prompt_lens)
    settings = load_settings(cp={"size": 1}, kv={"dtype": spec.kv_dtype, "pages_per_rank": need + 8},
                             backend={"preference": list(spec.backends)}, cache={"enabled": False})
    with recording():
        session = PrefillSession(model, settings, group)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
               for n in spec.prompt_lens]
    n = spec.decode_tokens

    def once(speculate: bool, tag: str) -> tuple[float, list[list[int]], dict[str, Any]]:
        rids = [f"{tag}{i}" for i in range(len(prompts))]
        with recording():
            res = session.prefill(list(zip(rids, prompts, strict=True)))
            first = greedy(res.last_logits)
            gc.collect()
            if cuda:
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            if speculate:
                assert res.draft_logits is not None
                toks, stats = speculative_generate(
                    session, list(zip(rids, first, greedy(res.draft_logits), strict=True)), n,
                    spec.draft_tokens)
                info: dict[str, Any] = stats.as_dict()
            else:
                toks, info = generate(session, list(zip(rids, first, strict=True)), n), {}
            if cuda:
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t
        for rid in rids:
            session.release(rid)
        return seconds, toks, info

    out: dict[str, Any] = {"ops": dict(session.ops.chosen)}
    for speculate, name in ((False, "plain"), (True, "speculative")):
        once(speculate, f"warm-{name}-")
        runs = [once(speculate, f"{name}{r}-") for r in range(spec.repeats)]
        out[name] = {"seconds": statistics.median(r[0] for r in runs),
                     "all": [r[0] for r in runs], "tokens": runs[0][1], "stats": runs[0][2]}
    out["tokens_match"] = out["plain"]["tokens"] == out["speculative"]["tokens"]
    # the first token comes from the prefill: the timed loop produces n - 1 per request
    made = len(prompts) * (n - 1)
    for name in ("plain", "speculative"):
        out[name]["tokens_per_s"] = made / out[name]["seconds"]
    return out


def agree_config(tokens: int, layers: int | None, gpu: bool) -> dict[str, Any]:
    """The config overrides of ``cpkv bench mtp``'s checkpoint (an MTP layer, positions for a
    ``tokens``-token prompt): on GPUs ``layers`` (default 2) at DeepSeek-V3.2's attention sizes,
    the MTP layer dense too; on CPUs the tiny model (``layers`` of it, when given)."""
    from cpkv.models.tiny import PRESETS

    over: dict[str, Any] = {"num_nextn_predict_layers": 1,
                            "max_position_embeddings": max(4096, 2 * tokens)}
    if gpu:
        n = layers or 2
        over |= {**PRESETS["v32-attention"], "num_hidden_layers": n,
                 "first_k_dense_replace": n + 1,  # the MTP layer dense too
                 "num_nextn_predict_layers": 1, "max_position_embeddings": 163840}
    elif layers:
        over |= {"num_hidden_layers": layers}
    return over


def rows(memory: list[dict[str, Any]] | None, decode: dict[str, Any] | None,
         tokens: int, k: int) -> list[BenchRow]:
    """The benchmark rows (ratios against the same run's baseline)."""
    out: list[BenchRow] = []
    size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
    if memory is not None:
        emb = {h: max(r[h]["embed_bytes"] for r in memory) for h in ("local", "full")}
        out.append(BenchRow.of(f"draft_embedding_{size}_cp2_local_mb",
                               emb["local"] / 2**20, "MiB",
                               "full-prompt embedding (plan withheld)", emb["full"] / 2**20))
        if all("peak_bytes" in r["local"] for r in memory):
            peak = {h: max(r[h]["peak_bytes"] for r in memory) for h in ("local", "full")}
            out.append(BenchRow.of(f"draft_prefill_{size}_cp2_peak_local_mb",
                                   peak["local"] / 2**20, "MiB",
                                   "draft layer peak with the full-prompt embedding",
                                   peak["full"] / 2**20))
    if decode is not None:
        out.append(BenchRow.of(f"decode_tok_s_speculative_k{k}",
                               decode["speculative"]["tokens_per_s"], "tok/s",
                               "plain greedy decoding, same checkpoint and prompts",
                               decode["plain"]["tokens_per_s"]))
    return out


def run(model_dir: str, agree_dir: str, *, tokens: int, prompt_lens: tuple[int, ...],
        decode_tokens: int, draft_tokens: int, kv_dtype: str, backends: tuple[str, ...],
        gpu: bool, progress: Callable[[str], None] = lambda s: None,
        ) -> tuple[list[BenchRow], dict[str, Any]]:
    """Both measurements (CP2 memory needs two ranks: GPUs with ``gpu``, else Gloo)."""
    from cpkv.runtime import run_ranks

    backend = "nccl" if gpu else "gloo"
    progress(f"CP2 draft prefill of {tokens} tokens, local vs full embedding")
    mem = [r.value for r in run_ranks(memory_rank, 2, backend=backend, timeout_s=580,
                                      args=(MemorySpec(model_dir, tokens, kv_dtype, backends),))]
    progress(f"decode {decode_tokens} tokens x {len(prompt_lens)} prompts, plain vs k={draft_tokens}")
    dec = run_ranks(decode_rank, 1, backend=backend, timeout_s=580,
                    args=(DecodeSpec(agree_dir, prompt_lens, decode_tokens, draft_tokens, kv_dtype,
                                     backends),))[0].value
    detail = {"memory": mem, "decode": {k: v for k, v in dec.items()},
              "tokens": tokens, "prompt_lens": list(prompt_lens), "decode_tokens": decode_tokens,
              "draft_tokens": draft_tokens, "kv_dtype": kv_dtype, "backends": list(backends)}
    return rows(mem, dec, tokens, draft_tokens), detail
