"""Warm-up before serving: every kernel variant a session's prompts can meet compiled before
the first request.

Triton compiles a kernel once per variant: the launch's constexprs (tile sizes picked from the
row and key counts, the top-k's long-row path from 192K keys) and its integer arguments'
specializations (divisible by 16 or not, 1, 32- or 64-bit). A fresh process meets a new variant
whenever a prompt first reaches a new bucket of these, and pays the compile (seconds) inside
that chunk: a 1M-token prompt on a fresh machine spent 20.5 s in one 64K chunk. DeepGEMM's JIT
(the cuda backend's indexer) likewise compiles per variant.

:func:`warm_up` runs, before serving, the prompts that meet every bucket up to ``tokens``: one
synthetic prompt of ``tokens - 1`` tokens (odd, so its last chunk's key count is not a multiple
of 16) in the session's chunks (``runtime.chunk_tokens``, else ``chunk``), and one short prompt
of an odd length (the small-key buckets); both released after. What it compiles stays in the
compile caches on disk (Triton's ``TRITON_CACHE_DIR``, default ``~/.triton/cache``;
DeepGEMM's ``DG_JIT_CACHE_DIR``, default ``~/.dj``): a later process on the same machine
loads the kernels instead of compiling them (measured in docs/perf.md: the first pass of such a
process over its second). Its own time is returned.

Every rank of the CP group calls it with the same arguments (the prefills are collectives).
A session runs it itself when it starts with ``runtime.warmup_tokens`` set
(:attr:`PrefillSession.warmup <cpkv.runtime.session.PrefillSession.warmup>`); ``cpkv warmup``
runs it alone on one device. The report counts the kernels the caches gained
(:func:`compiled_kernels` before and after): on a machine whose caches already hold them, none.
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from cpkv.comm import note_progress

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.models import DeepseekV32
    from cpkv.settings import Settings

__all__ = ["WarmupReport", "WarmupSession", "compile_cache_dirs", "compiled_kernels", "warm_up"]


class WarmupSession(Protocol):
    """What :func:`warm_up` uses of a :class:`~cpkv.runtime.session.PrefillSession` (which
    calls it from its start, so this module cannot import it)."""

    settings: Settings
    model: DeepseekV32
    group: CPGroup

    def prefill(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> object: ...

    def release(self, rid: Hashable) -> None: ...

#: the short prompt's length (odd; under a 64-token page multiple)
SHORT_PROMPT = 1001


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warm_up` ran and how long it took (wall seconds, device work included)."""

    tokens: int
    chunk: int
    seconds: float
    #: wall seconds of each chunk of the long prompt, in order
    chunk_seconds: tuple[float, ...] = field(default=())
    #: kernels the compile caches gained during the warm-up (0: all were there already)
    compiled: int = 0
    #: kernels in the compile caches after it
    cached: int = 0


def compile_cache_dirs() -> tuple[Path, Path]:
    """Triton's and DeepGEMM's on-disk compile caches as this process uses them:
    ``TRITON_CACHE_DIR`` (else ``$TRITON_HOME/.triton/cache``, ``TRITON_HOME`` defaulting to the
    home directory) and the first path of ``DG_JIT_CACHE_DIR`` (else ``~/.dj``)."""
    tri = os.environ.get("TRITON_CACHE_DIR") or str(
        Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache")
    dg = (os.environ.get("DG_JIT_CACHE_DIR") or str(Path.home() / ".dj")).split(":")[0]
    return Path(tri), Path(dg)


def compiled_kernels() -> frozenset[str]:
    """The compiled kernels in the caches (:func:`compile_cache_dirs`): Triton's metadata files
    (``<hash>/<kernel>.json``, group files left out) as ``hash8:kernel`` and DeepGEMM's kernel
    directories (``<dir>/cache/<kernel>``) as ``deepgemm:kernel``."""
    tri, dg = compile_cache_dirs()
    out: set[str] = set()
    if tri.is_dir():
        out |= {f"{p.parent.name[:8]}:{p.stem}" for p in tri.glob("*/*.json")
                if not p.name.startswith("__grp__")}
    if (dg / "cache").is_dir():
        out |= {f"deepgemm:{p.name}" for p in (dg / "cache").iterdir()}
    return frozenset(out)


def _ids(t: torch.Tensor) -> Sequence[int]:
    """Token ids as the session takes them (a 1-D int64 tensor is a sequence of ints to it)."""
    return cast(Sequence[int], t)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def warm_up(session: WarmupSession, tokens: int, chunk: int = 65536, seed: int = 0
            ) -> WarmupReport:
    """Prefill the warm-up prompts (module docstring) on ``session``; returns their time.

    Args:
        session: the session that will serve (its pool must hold ``tokens`` tokens).
        tokens: the longest prompt the session will serve (its key count).
        chunk: the chunk size when ``runtime.chunk_tokens`` is 0 (prompts prefilled whole);
            a multiple of the page size.

    Raises:
        ValueError: ``tokens`` < 2 or ``chunk`` not a positive multiple of the page size.
        PoolExhausted: the pool cannot hold ``tokens`` tokens.
    """
    ps = session.settings.kv.page_size
    c = session.settings.runtime.chunk_tokens or chunk
    if tokens < 2 or c <= 0 or c % ps:
        raise ValueError(f"warm_up: tokens >= 2 and a chunk that is a multiple of the page "
                         f"size {ps}, got tokens={tokens}, chunk={c}")
    g = torch.Generator().manual_seed(seed)
    vocab = session.model.config.vocab_size
    dev = session.group.device
    before = compiled_kernels()
    start = time.perf_counter()
    per: list[float] = []
    ids = torch.randint(0, vocab, (tokens - 1,), generator=g)
    short = torch.randint(0, vocab, (min(SHORT_PROMPT, tokens - 1),), generator=g)
    total = ids.numel() + short.numel()
    note_progress("warmup", 0, total)
    for s in range(0, ids.numel(), c):
        t = time.perf_counter()
        session.prefill([("cpkv-warmup", _ids(ids[s:s + c]))])
        _sync(dev)
        per.append(time.perf_counter() - t)
        note_progress("warmup", min(s + c, ids.numel()), total)
    session.release("cpkv-warmup")
    session.prefill([("cpkv-warmup-short", _ids(short))])
    _sync(dev)
    session.release("cpkv-warmup-short")
    note_progress("warmup", total, total)
    seconds = time.perf_counter() - start
    after = compiled_kernels()
    return WarmupReport(tokens=tokens, chunk=c, seconds=seconds, chunk_seconds=tuple(per),
                        compiled=len(after - before), cached=len(after))
