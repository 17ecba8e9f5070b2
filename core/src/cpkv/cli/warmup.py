"""``cpkv warmup``: compile every kernel variant a prefill session meets up to N tokens on this
machine, so that the compile caches on disk hold them before an engine serves
(:mod:`cpkv.runtime.warmup`; the session option ``runtime.warmup_tokens`` does the same inside
each session at its start). One process, one device, CP1: the settings' model, formats and chunks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click
import torch

from ._errors import load_for_command
from ._state import CliState

#: the settings key each option sets, for error lines (:class:`Sources`)
OPTIONS = {"run.model": "--model", "run.device": "--device", "runtime.chunk_tokens": "--chunk"}


def caches_line(triton: Path, deepgemm: Path, with_deepgemm: bool) -> str:
    """The compile caches a warm-up fills, each named: ``Triton's /root/.triton/cache`` and,
    where DeepGEMM is installed, ``DeepGEMM's /root/.dj`` (a bare ``a; b`` read as one broken
    path, and DeepGEMM's directory means nothing where it is not installed)."""
    named = [f"Triton's {triton}"] + ([f"DeepGEMM's {deepgemm}"] if with_deepgemm else [])
    return " and ".join(named)


def _device(choice: str) -> torch.device:
    """``run.device`` for one process: cuda is GPU 0; auto is cuda where there is a GPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("run.device = 'cuda', but this machine has no CUDA device")
    return torch.device("cuda", 0) if choice == "cuda" else torch.device("cpu")


@click.command("warmup")
@click.option("--tokens", type=click.IntRange(min=2), default=None,
              help="The longest prompt to warm up for (key count) [runtime.warmup_tokens].")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Settings TOML file (CPKV_* environment variables override it; flags override both).")
@click.option("--model", default=None, help="Checkpoint directory, or 'tiny' (run.model).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default=None,
              help="cpu (float32 model) or cuda (GPU 0, bfloat16 model); auto: cuda where there "
                   "is a GPU (run.device).")
@click.option("--chunk", type=click.IntRange(min=0), default=None,
              help="Prefill the warm-up prompt in chunks of N tokens as the sessions will "
                   "(runtime.chunk_tokens; 0: whole).")
@click.pass_obj
def command(state: CliState | None, tokens: int | None, config: Path | None, model: str | None,
            device: str | None, chunk: int | None) -> None:
    """Warm this machine's compile caches (Triton's, DeepGEMM's) for prompts up to --tokens:
    prefill the warm-up prompts on one device and print the time and the kernels compiled.

    A later process loads the kernels from the caches instead of compiling them; a session
    warms up itself with runtime.warmup_tokens."""
    from cpkv.comm import CPGroup
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession
    from cpkv.runtime.warmup import compile_cache_dirs

    over: dict[str, dict[str, object]] = {}
    given: dict[str, object] = {"model": model, "device": device}
    run_over = {k: v for k, v in given.items() if v is not None}
    if run_over:
        over["run"] = run_over
    if chunk is not None:
        over["runtime"] = {"chunk_tokens": chunk}
    settings, ckpt, sources = load_for_command(OPTIONS, over, config)
    n = tokens or settings.runtime.warmup_tokens
    if not n:
        raise click.UsageError("give --tokens N (or set runtime.warmup_tokens): the longest "
                               "prompt to warm up for")
    dev = _device(settings.run.device)
    ps = settings.kv.page_size
    # one rank holds the whole warm-up prompt (and no more pages than the settings give, if more)
    pages = max(settings.kv.pages_per_rank, -(-n // ps) + 1)
    settings = settings.with_cp_size(1).model_copy(update={
        "kv": settings.kv.model_copy(update={"pages_per_rank": pages}),
        "runtime": settings.runtime.model_copy(update={"warmup_tokens": n})})
    if (problem := settings.cross_section_problem()) is not None:
        raise click.ClickException(sources.lead(problem))
    click.echo(f"model {ckpt} on {dev}: warming up for {n:,} tokens")
    m = load_model(ckpt, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                   device=dev, mtp=settings.run.mtp)
    session = PrefillSession(m, settings, CPGroup.single(dev, settings.runtime.timeout_s))
    rep = session.warmup
    assert rep is not None  # runtime.warmup_tokens is set
    tri, dg = compile_cache_dirs()
    how = f"{rep.chunk:,}-token chunks" if rep.chunk < n else "one piece"
    click.echo(f"warm-up: {rep.seconds:.2f} s ({len(rep.chunk_seconds)} chunk(s) in {how}, "
               f"longest {max(rep.chunk_seconds):.2f} s); {rep.compiled} kernel(s) compiled, "
               f"{rep.cached} in the compile caches "
               f"({caches_line(tri, dg, importlib.util.find_spec('deep_gemm') is not None)})")
