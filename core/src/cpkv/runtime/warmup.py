"""Warm-up before serving: every kernel variant a session's prompts can meet compiled before
the first request (issue 38).

Triton compiles a kernel once per variant: the launch's constexprs (tile sizes picked from the
row and key counts, the top-k's long-row path from 192K keys) and its integer arguments'
specializations (divisible by 16 or not, 1, 32- or 64-bit). A fresh process meets a new variant
whenever a prompt first reaches a new bucket of these, and pays the compile (seconds) inside
that chunk: a 1M-token prompt on a fresh H200 spent 20.5 s in one 64K chunk. DeepGEMM's JIT
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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from .session import PrefillSession

__all__ = ["WarmupReport", "warm_up"]

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


def _ids(t: torch.Tensor) -> Sequence[int]:
    """Token ids as the session takes them (a 1-D int64 tensor is a sequence of ints to it)."""
    return cast(Sequence[int], t)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def warm_up(session: PrefillSession, tokens: int, chunk: int = 65536, seed: int = 0
            ) -> WarmupReport:
    """Prefill the warm-up prompts (module docstring) on ``session``; returns their time.

    Args:
        session: the session that will serve (its pool must hold ``tokens`` tokens).
        tokens: the longest prompt the session will serve (its key count).
        chunk: the chunk size when ``runtime.chunk_tokens`` is 0 (prompts prefilled whole);
            a multiple of the page size.

    Raises:
        ValueError: ``tokens`` < 2 or ``chunk`` not a positive multiple of the page size.
    """
    ps = session.settings.kv.page_size
    c = session.settings.runtime.chunk_tokens or chunk
    if tokens < 2 or c <= 0 or c % ps:
        raise ValueError(f"warm_up: tokens >= 2 and a chunk that is a multiple of the page "
                         f"size {ps}, got tokens={tokens}, chunk={c}")
    g = torch.Generator().manual_seed(seed)
    vocab = session.model.config.vocab_size
    dev = session.group.device
    start = time.perf_counter()
    per: list[float] = []
    ids = torch.randint(0, vocab, (tokens - 1,), generator=g)
    for s in range(0, ids.numel(), c):
        t = time.perf_counter()
        session.prefill([("cpkv-warmup", _ids(ids[s:s + c]))])
        _sync(dev)
        per.append(time.perf_counter() - t)
    session.release("cpkv-warmup")
    short = torch.randint(0, vocab, (min(SHORT_PROMPT, tokens - 1),), generator=g)
    session.prefill([("cpkv-warmup-short", _ids(short))])
    _sync(dev)
    session.release("cpkv-warmup-short")
    return WarmupReport(tokens=tokens, chunk=c, seconds=time.perf_counter() - start,
                        chunk_seconds=tuple(per))
