"""``cpkv run`` on a DeepSeek-V4 checkpoint: the job of :mod:`cpkv.runtime.v4_job` (CP prefill,
and with ``--decode-tokens`` the transfer of each rank's owned entries and the tail bundle to a
decode rank, then greedy decode) and its report (correctness against one rank, decode tokens
against the one-rank forward, KV bytes per rank against the entries once plus the tail objects,
bytes sent and tail bundle bytes, bytes per token of context beside DeepSeek-V3.2's,
fallbacks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import torch
from rich.console import Console
from rich.table import Table

from cpkv.models.v4_objects import (
    V3_2_FP8_BYTES_PER_TOKEN,
    V4_FLASH,
    V4_PRO,
    fp8_bytes_per_token,
)

if TYPE_CHECKING:
    from cpkv.runtime.v4_job import V4OpsChoice
    from cpkv.settings import Settings

__all__ = ["PER_TOKEN_ROWS", "run_v4"]

TOLERANCE = 2e-3

#: the bytes per token of context of the FP8 pools (docs/models.md)
PER_TOKEN_ROWS = (("DeepSeek-V4-Flash (43 layers)", fp8_bytes_per_token(V4_FLASH)),
                  ("DeepSeek-V4-Pro (61 layers)", fp8_bytes_per_token(V4_PRO)),
                  ("DeepSeek-V3.2 (61 layers)", V3_2_FP8_BYTES_PER_TOKEN))


def run_v4(ckpt: Path, prompts: list[list[int]], cp: int, mode: str, page_size: int,
           chunk: int, decode_tokens: int, console: Console, report: Path | None,
           save_logits: Path | None, device: str = "cpu", ops: V4OpsChoice | None = None, *,
           settings: Settings | None = None) -> None:
    """Run the V4 job and print its report; exit 1 when a prompt's last-position logits are
    off the one-rank forward by more than :data:`TOLERANCE` (relative) or their argmax differs,
    or a decoded token is not the one-rank forward's argmax after the tokens before it.
    ``settings``: the run's (the transfer plugin and its options, with ``decode_tokens``).

    Raises:
        click.ClickException: a chunk size off the ownership unit, a window wider than it,
            ``device`` "cuda" with fewer GPUs than ranks.
    """
    from cpkv.runtime.v4_job import V4OpsChoice

    ops = ops or V4OpsChoice()
    console.print(f"model {ckpt} (DeepSeek-V4), CP{cp} {mode}, page {page_size}, "
                  f"{len(prompts)} prompts, device {device}, v4 ops from "
                  f"{', '.join(ops.preference)}")
    mtp = settings is not None and settings.run.mtp
    if decode_tokens:
        name = settings.transfer.name if settings is not None else "the default"
        how = (f"speculatively ({settings.run.draft_tokens} MTP drafts a step)"
               if settings is not None and mtp else "greedily")
        console.print(f"decode: {decode_tokens} tokens a prompt {how} on a decode rank, owned "
                      f"entries and the tail bundle sent over the {name} transfer plugin")
    elif mtp:
        console.print("the MTP draft layer runs under the CP prefill (no decode: its last-"
                      "position logits are checked)")
    try:
        rep = _job(ckpt, prompts, cp, mode, page_size, chunk, decode_tokens, settings, device,
                   ops)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    hits = _print_hits(rep, console)
    drafts = _print_tables(rep, console)
    passed = rep.passed(TOLERANCE)
    what = "prefill + decode" if rep.tokens else "prefill"
    mode = settings.run.reference if settings is not None else "full"
    if not rep.any_checked:
        console.print(f"{what} CP{cp}: not checked against one rank (run.reference = {mode}"
                      f"{'' if mode == 'off' else ': every prompt is longer than run.reference_tokens'}"
                      f"); {rep.seconds:.1f} s")
    else:
        some = "" if all(rep.is_checked(i) for i in range(len(rep.lengths))) else (
            f", the prompts of at most run.reference_tokens = "
            f"{settings.run.reference_tokens if settings else 0} tokens")
        console.print(f"{what} CP{cp} vs one rank: {'PASS' if passed else 'FAIL'} "
                      f"(tolerance {TOLERANCE:g} relative, argmax equal"
                      f"{', decode tokens equal' if rep.tokens else ''}{some}); "
                      f"{rep.seconds:.1f} s")
    if report:
        body: dict[str, Any] = {
            "model": str(ckpt), "family": "DeepSeek-V4", "cp": cp, "mode": mode,
            "page_size": page_size, "prompt_lens": rep.lengths, "rel_diff": _json_floats(rep.rel_diff()),
            "argmax_equal": rep.argmax_equal(), "kv_bytes_per_rank": rep.rank_bytes,
            "kv_bytes_entries": rep.entry_bytes, "kv_bytes_tail": rep.tail_bytes,
            "fallbacks": [f.model_dump(mode="json") for f in rep.fallbacks],
            "decode_tokens": rep.tokens, "reference_tokens": rep.reference_tokens,
            "decode_equal": rep.tokens_equal(), "bytes_sent_per_rank": rep.bytes_sent,
            "tail_bundle_bytes": rep.bundle_bytes, "draft_rel_diff": _json_floats(drafts),
            "speculation": (None if rep.speculation is None else
                            {"steps": rep.speculation.steps, "drafted": rep.speculation.drafted,
                             "accepted": rep.speculation.accepted}),
            "reference": mode, "checked": [rep.is_checked(i) for i in range(len(rep.lengths))],
            "tolerance": TOLERANCE, "correct": passed if rep.any_checked else None, **hits}
        report.write_text(json.dumps(body, indent=2) + "\n")
    if save_logits:
        torch.save(rep.logits.float().contiguous(), save_logits)
    if not passed:
        raise SystemExit(1)


def _json_floats(xs: list[float]) -> list[float | None]:
    """NaN (not checked) as null: JSON has no NaN."""
    return [None if x != x else x for x in xs]


def _print_tables(rep: Any, console: Console) -> list[float]:
    """The report's tables (logits against one rank, KV bytes, decode, bytes per token,
    fallbacks); -> the MTP layer's relative differences (none without it)."""
    drafts: list[float] = rep.draft_rel_diff()
    t = Table()
    cols = ["prompt", "tokens", "max |CP - one rank| / max |one rank|", "argmax equal"]
    for col in cols + (["MTP layer: the same"] if drafts else []):
        t.add_column(col, justify="right")
    for i, (n, d, ok) in enumerate(zip(rep.lengths, rep.rel_diff(), rep.argmax_equal(),
                                       strict=True)):
        if ok is None:
            t.add_row(str(i), str(n), "not checked", "-", *(["-"] if drafts else []))
            continue
        t.add_row(str(i), str(n), f"{d:.2e}", "yes" if ok else "NO",
                  *([f"{drafts[i]:.2e}"] if drafts else []))
    console.print(t)
    total = rep.entry_bytes + rep.tail_bytes
    kv = Table(title="KV bytes per rank (fp32 pool): entries each once, tail objects on the "
                     "last token's rank")
    for col in ("rank", "bytes", "of entries + tail"):
        kv.add_column(col, justify="right")
    for r, b in enumerate(rep.rank_bytes):
        kv.add_row(str(r), f"{b:,}", f"{b / max(1, total):.1%}")
    kv.add_row("entries", f"{rep.entry_bytes:,}", "")
    kv.add_row("tail", f"{rep.tail_bytes:,}", "")
    console.print(kv)
    if rep.tokens:
        dt = Table(title="Decode on the decode rank vs the one-rank forward")
        for col in ("prompt", "tokens", "equal", "tail bundle bytes"):
            dt.add_column(col, justify="right")
        for i, (toks, ok, b) in enumerate(zip(rep.tokens, rep.tokens_equal(), rep.bundle_bytes,
                                              strict=True)):
            dt.add_row(str(i), " ".join(map(str, toks)),
                       "-" if ok is None else "yes" if ok else "NO", f"{b:,}")
        console.print(dt)
        console.print("bytes sent per prefill rank (staged pages): "
                      + ", ".join(f"{b:,}" for b in rep.bytes_sent))
        if rep.speculation is not None:
            sp = rep.speculation
            console.print(f"speculative decode: {sp.steps} verify steps, {sp.accepted} of "
                          f"{sp.drafted} drafts accepted ({sp.acceptance:.0%}); tokens "
                          "equal to greedy")
    pt = Table(title="KV bytes per token of context (FP8 pools)")
    pt.add_column("model")
    pt.add_column("bytes", justify="right")
    for name, per_token in PER_TOKEN_ROWS:
        pt.add_row(name, f"{per_token:,.1f}")
    console.print(pt)
    for f in rep.fallbacks:
        console.print(f"fallback: {f.op}: {f.requested} -> {f.selected} ({f.reason}): {f.detail}")
    return drafts


def _print_hits(rep: object, console: Console) -> dict[str, Any]:
    """The prefix cache's table (served through it: each prompt's hit, the snapshot boundary it
    resumed from, the tokens computed) and its report keys; nothing without the cache."""
    from cpkv.runtime.v4_cache_job import V4CachedJobReport

    if not isinstance(rep, V4CachedJobReport):
        return {}
    t = Table(title=f"V4 prefix cache (snapshots every {rep.snapshot_tokens} tokens and at each "
                    f"prompt's last unit boundary)")
    for col in ("prompt", "tokens", "hit tokens", "snapshot boundary", "computed"):
        t.add_column(col, justify="right")
    for i, (n, h, b, c) in enumerate(zip(rep.lengths, rep.hit_tokens, rep.boundaries,
                                         rep.computed_tokens, strict=True)):
        t.add_row(str(i), str(n), str(h), str(b), str(c))
    console.print(t)
    return {"prefix_cache": {"snapshot_tokens": rep.snapshot_tokens, "hit_tokens": rep.hit_tokens,
                             "snapshot_boundary": rep.boundaries,
                             "computed_tokens": rep.computed_tokens}}


def _job(ckpt: Path, prompts: list[list[int]], cp: int, mode: str, page_size: int, chunk: int,
         decode_tokens: int, settings: Settings | None, device: str, ops: V4OpsChoice) -> Any:
    """The V4 job, through the prefix cache when ``cache.v4_prefix`` (and the cache) is on."""
    from cpkv.runtime.v4_cache_job import run_v4_cached_job
    from cpkv.runtime.v4_job import run_v4_job

    if settings is None or not (settings.cache.enabled and settings.cache.v4_prefix):
        return run_v4_job(str(ckpt), prompts, cp, mode, page_size, chunk, device=device, ops=ops,
                          decode_tokens=decode_tokens, settings=settings)
    return run_v4_cached_job(str(ckpt), prompts, cp, mode, page_size, chunk,
                             snapshot_tokens=settings.cache.v4_snapshot_tokens,
                             decode_tokens=decode_tokens, settings=settings, device=device,
                             ops=ops)
