"""``cpkv run``: the main job.

CP prefill of prompts on ``cp.size`` rank processes (Gloo on CPU, NCCL on GPUs) over the sharded
KV pool, the transfer of each rank's pages to a non-CP decode rank with the transfer plugin
(``transfer.name``), greedy decoding there, the same prompts on one rank as the reference
(prefill and greedy generation), and a report: KV bytes per rank against a replicated pool,
transfer bytes per rank, time per phase, fallbacks, correctness.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.table import Table

from cpkv.contracts import SplitMode
from cpkv.models import ModelLoadError
from cpkv.models.loader import read_config
from cpkv.models.v4_weights import is_v4_checkpoint
from cpkv.runtime.job import Check, JobReport, Verdict, run_job
from cpkv.runtime.job.run import check_plugin_names
from cpkv.settings import Settings, SettingsError

from ._console import output_console
from ._errors import load_for_command
from ._logging import RankLogging, configure_logging, level_from_flags
from ._outputs import check_output, write_atomic
from ._progress import ProgressLine
from ._report import engine_log_env, report_context
from ._signals import stop_at_once_on_signals
from ._state import CliState

#: the default prompts (see _default_prompts): a long one, one sharing its first 100 tokens
#: (a cache hit that ends inside a 64-token page), a short extend (it takes the visible
#: token-balanced fallback), and a multi-turn follow-up that extends the first one
DEFAULT_LENGTHS = (600, 300, 40, 660)


def _default_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    first = toks(DEFAULT_LENGTHS[0])
    return [first, first[:100] + toks(DEFAULT_LENGTHS[1] - 100), toks(DEFAULT_LENGTHS[2]),
            first + toks(DEFAULT_LENGTHS[3] - len(first))]


def _prompts(path: str | None, vocab: int, source: str = "--prompts") -> list[list[int]]:
    """The prompts file's token lists; a bad file is one line naming ``source`` (the option or
    the settings key and where it was set), the file, the prompt index, and the fix."""
    if path is None:
        return _default_prompts(vocab)
    where = f"{source} {path}"
    fix = "a JSON list of prompts, each a non-empty list of token ids, e.g. [[1, 2, 3], [4, 5]]"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise click.ClickException(f"{where}: cannot read it ({exc.strerror or exc}); name an "
                                   f"existing file holding {fix}") from None
    if not text.strip():
        raise click.ClickException(f"{where}: the file is empty; it must hold {fix}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column "
                                   f"{exc.colno}); it must hold {fix}") from None
    if not isinstance(data, list) or not data:
        raise click.ClickException(f"{where}: holds {type(data).__name__ if data else 'nothing'}"
                                   f"; it must hold {fix}")
    for i, p in enumerate(data):
        if not isinstance(p, list) or not p or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise click.ClickException(f"{where}: prompt {i} is not a non-empty list of token ids "
                                       f"(got {json.dumps(p)[:60]}); the file must hold {fix}")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise click.ClickException(f"{where}: prompt {i} has token ids {bad[:5]} outside the "
                                       f"vocabulary [0, {vocab}) of the model; use ids below {vocab}")
    return data


def _prompts_source(option: str | None, config: Path | None) -> str:
    """What set run.prompts, for messages: the option, or the settings key and its source."""
    import os

    if option is not None:
        return "--prompts"
    if "CPKV_RUN__PROMPTS" in os.environ:
        return "run.prompts (CPKV_RUN__PROMPTS)"
    return f"run.prompts (in {config})" if config is not None else "run.prompts"


def _write(option: str, path: Path, write: Callable[[Path], object]) -> None:
    """:func:`write_atomic`, a failure as one line naming ``option`` (the report was shown)."""
    try:
        write_atomic(path, write)
    except OSError as exc:
        raise click.ClickException(f"{option} {path}: writing failed: {exc.strerror or exc}; "
                                   f"nothing was written there") from exc


def _table() -> Table:
    """A report table whose cells never wrap (a narrow terminal scrolls instead of breaking a
    number or a word); its title is printed before it as a line, which wraps between words."""
    return Table()


def _column(t: Table, name: str, right: bool = True) -> None:
    t.add_column(name, justify="right" if right else "left", no_wrap=True)


#: the phase table's rows: (name, key in the report's ``seconds`` for CP, for the reference)
PHASES = (("startup (spawn, imports, model load)", "cp_startup", "reference_startup"),
          ("prefill (every batch)", "cp_prefill", "reference_prefill"),
          ("decode", "cp_decode", "reference_decode"),
          ("total (wall)", "cp_total", "reference_total"))


def _where(rep: JobReport) -> str:
    """The device, and on GPUs each process's GPU (the prefill ranks', then the decode rank's)."""
    if rep.gpus is None:
        return rep.device
    where = f"{rep.device} (GPUs {', '.join(map(str, rep.gpus))}"
    if len(rep.gpus) > rep.cp and rep.gpus[rep.cp] in rep.gpus[:rep.cp]:
        where += f": the decode rank shares GPU {rep.gpus[rep.cp]}"
    return where + ")"


def sharding_line(rep: JobReport, pool_tokens: int) -> str:
    """What sharding saved, in one line: the largest rank's KV against a replica, the group's
    total against C replicas, and the tokens the pool holds per rank."""
    rep_b = max(1, rep.kv_bytes_replicated)
    most, total = max(rep.kv_bytes_per_rank), sum(rep.kv_bytes_per_rank)
    return (f"sharding saved: the largest rank holds {most / rep_b:.1%} of a replica's KV "
            f"({rep_b - most:,} bytes less), the group {total / (rep.cp * rep_b):.1%} of "
            f"{rep.cp} replicas'; the pool holds {pool_tokens:,} tokens per rank")


def _mark(good: bool) -> str:
    return "[green]correct[/]" if good else "[red]MISMATCH[/]"


def _render_phases(rep: JobReport, console: Console) -> None:
    """The time per phase table."""
    sec = rep.seconds.to_json()
    console.print(f"time per phase, seconds (CP{rep.cp}: the slowest rank; the reference: one "
                  f"rank in this process, so no spawn)")
    pt = _table()
    _column(pt, "phase", right=False)
    _column(pt, f"CP{rep.cp}")
    _column(pt, "reference")
    for name, cp_key, ref_key in PHASES:
        if cp_key in sec:
            pt.add_row(name, f"{sec[cp_key]:.3f}", f"{sec[ref_key]:.3f}" if ref_key in sec else "-")
    shown = {k for _, cp_key, ref_key in PHASES for k in (cp_key, ref_key)}
    details = [k for k in sec if k not in shown]
    for detail in details:
        pt.add_row(f"  {detail}", f"{sec[detail]:.3f}", "")
    console.print(pt)


def _render(rep: JobReport, verdict: Verdict, console: Console, pool_tokens: int = 0) -> None:
    """The report as tables and lines, each check marked as the verdict decided it; the
    verdict's failures last."""
    tol, failed = verdict.tolerance, verdict.failed
    console.print(f"KV per rank: CP{rep.cp} {rep.mode} on {_where(rep)}, {rep.kv_dtype} pool, "
                  f"{rep.indexer_dtype} indexer, "
                  f"{rep.materialize} views (prompts of {', '.join(map(str, rep.prompt_lens))} "
                  f"tokens)")
    t = _table()
    for col in ("rank", "KV bytes", "vs replicated"):
        _column(t, col)
    for r, b in enumerate(rep.kv_bytes_per_rank):
        t.add_row(str(r), f"{b:,}", f"{b / max(1, rep.kv_bytes_replicated):.1%}")
    t.add_row("replica", f"{rep.kv_bytes_replicated:,}", "100.0%")
    console.print(t)
    console.print(sharding_line(rep, pool_tokens))
    _render_phases(rep, console)
    seen = set()
    for row in rep.fallbacks:
        f = row.event
        key = (f.op, f.reason, f.detail)
        if key not in seen:
            seen.add(key)
            console.print(f"[yellow]fallback[/] {f.op}: {f.requested} -> {f.selected} "
                          f"({f.reason.value}): {f.detail}", soft_wrap=True)
    ok = not failed & {Check.LOGITS, Check.TOPK}
    err = rep.max_rel_err_vs_reference
    if verdict.checked & {Check.LOGITS, Check.TOPK}:
        console.print(f"{_mark(ok)}: CP logits vs one rank: max relative error "
                      + (f"{err:.2e} (tolerance {tol:.0e})" if err is not None else "not checked")
                      + f"; rows with different top-k sets: {rep.topk_rows_differing}",
                      soft_wrap=True)
    _render_reference(rep, console)
    by: dict[str, list[str]] = {}
    for op, name in rep.backends.chosen.items():
        by.setdefault(name, []).append(op)
    console.print("backends: " + "; ".join(f"{n} ({', '.join(ops)})" for n, ops in by.items())
                  + "".join(f"\n  passed over: {why}" for why in rep.backends.skipped),
                  soft_wrap=True)
    if rep.logits_budget is not None:
        lb = rep.logits_budget
        console.print(f"indexer logits budget: {', '.join(map(str, lb.mb_per_rank))} MiB per "
                      f"rank{' (auto)' if lb.auto else ''}")
    if rep.chunks is not None:
        per = rep.chunks.seconds_per_batch
        console.print(f"chunked prefill ({rep.chunks.chunk_tokens} tokens), seconds per chunk: "
                      + "; ".join(f"batch {i}: {', '.join(f'{x:.3f}' for x in ts)}"
                                  for i, ts in enumerate(per) if ts)
                      + (" (no prompt was longer)" if not any(per) else ""), soft_wrap=True)
    if rep.warmup is not None:
        w = rep.warmup
        console.print(f"warm-up ({w.tokens:,} tokens) at session start: "
                      f"{', '.join(f'{x:.2f}' for x in w.seconds_per_rank)} s per rank, "
                      f"kernels compiled {', '.join(map(str, w.compiled_per_rank))}",
                      soft_wrap=True)
    if rep.cache is not None:
        c = rep.cache
        console.print(f"prefix cache: hit tokens per prompt {c.hit_tokens} "
                      f"({c.hit_fraction:.1%} of all prompt tokens), pages evicted "
                      f"{c.pages_evicted}, saved to / loaded from the host tier "
                      f"{c.pages_saved_to_host} / {c.pages_loaded_from_host}",
                      soft_wrap=True)
    if rep.transfer is not None and rep.decode is not None:
        tr = rep.transfer
        console.print(f"transfer ({tr.plugin}): pipelined by {tr.pipeline}, bytes per "
                      f"prefill rank {', '.join(f'{b:,}' for b in tr.bytes_per_rank)}; "
                      f"{tr.entries} coalesced runs; {tr.seconds:.3f} s; ready "
                      f"{tr.ready_seconds:.3f} s after the prefills started, "
                      f"{tr.overlap_seconds:.3f} s of sending hidden behind them",
                      soft_wrap=True)
        st = rep.decode.steps
        how = (f"CUDA graphs ({st.captured} step shapes captured)" if st is not None and st.graphs
               else "eager")
        mark = _mark(Check.DECODE_TOKENS not in failed) \
            if Check.DECODE_TOKENS in verdict.checked else "not checked"
        console.print(f"{mark}: decode greedy tokens vs one-process generation ({how} steps): "
                      f"{rep.decode.tokens}", soft_wrap=True)
    _render_draft(rep, verdict, console)
    for why in verdict.failures:
        console.print(f"[red]failed[/]: {why}", soft_wrap=True)


def _render_draft(rep: JobReport, verdict: Verdict, console: Console) -> None:
    """The MTP draft layer's checks."""
    d = rep.draft
    if d is None:
        return
    failed = verdict.failed
    derr = d.prefill_max_rel_err_vs_reference
    if derr is not None:
        console.print(f"{_mark(Check.DRAFT_LOGITS not in failed)}: MTP draft logits (CP "
                      f"prefill) vs one rank: max relative error {derr:.2e}")
    sp = d.speculation
    if sp is not None:
        console.print(f"{_mark(Check.SPECULATIVE_TOKENS not in failed)}: speculative decoding "
                      f"(k = {sp.draft_tokens}): accept rate "
                      f"{sp.accept_rate:.1%}, mean accepted length "
                      f"{sp.mean_accepted_length:.2f}, {sp.steps} decode steps instead of "
                      f"{sp.plain_steps} ({sp.steps_saved} saved); tokens equal plain "
                      f"greedy on one rank: {d.tokens_match_reference}", soft_wrap=True)


def _render_reference(rep: JobReport, console: Console) -> None:
    """What the one-rank reference computed, what was compared with it and what not."""
    ref = rep.reference
    if ref is None:
        return
    what = f"run.reference = {ref.mode!r}"
    if ref.mode == "sample":
        what += f" (each prompt up to {ref.sample_tokens:,} tokens)"
    console.print(f"reference check: {what}, {ref.seconds:.1f} s; compared: "
                  + ("; ".join(ref.checked) or "nothing")
                  + "".join(f"\n  not compared: {why}" for why in ref.not_checked),
                  soft_wrap=True)


#: the settings key each option of ``cpkv run`` sets, for error lines (:class:`Sources`)
OPTIONS = {"cp.size": "--cp", "cp.mode": "--mode", "run.model": "--model",
           "run.prompts": "--prompts", "run.device": "--device", "run.mtp": "--mtp",
           "run.draft_tokens": "--draft-tokens", "runtime.chunk_tokens": "--chunk",
           "run.reference": "--reference"}


def _overrides(*, cp: int | None, mode: str | None, model: str | None, prompts: str | None,
               device: str | None, mtp: bool | None, draft_tokens: int | None,
               chunk: int | None, reference: str | None = None) -> dict[str, dict[str, object]]:
    """The settings overrides the command line gives (sections of the options set, None: unset)."""
    over: dict[str, dict[str, object]] = {}
    if cp is not None or mode is not None:
        over["cp"] = {k: v for k, v in {"size": cp, "mode": mode}.items() if v is not None}
    given: dict[str, object] = {"model": model, "prompts": prompts, "device": device, "mtp": mtp,
                                "draft_tokens": draft_tokens, "reference": reference}
    run_over = {k: v for k, v in given.items() if v is not None}
    if run_over:
        over["run"] = run_over
    if chunk is not None:
        over["runtime"] = {"chunk_tokens": chunk}
    return over


def _checkpoint_config(settings: Settings, ckpt: Path) -> Any:
    """The checkpoint's DeepSeek-V3.2 / GLM-5 config (None for DeepSeek-V4); a checkpoint that
    cannot serve the settings (no MTP layer for run.mtp, a bad config) is one line."""
    if is_v4_checkpoint(ckpt):
        return None
    try:
        cfg = read_config(ckpt)
        if settings.run.mtp and cfg.num_nextn_predict_layers < 1:
            raise ModelLoadError(f"{ckpt}: run.mtp asks for the MTP draft layer, but this checkpoint "
                                 f"has none (config.json: num_nextn_predict_layers = "
                                 f"{cfg.num_nextn_predict_layers})")
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    return cfg


def _run_v4(settings: Any, ckpt: Path, prompts: str | None, config: Path | None,
            decode_tokens: int, report: Path | None, save_logits: Path | None) -> None:
    from cpkv.models.v4_weights import read_v4_config
    from cpkv.runtime.v4_job import V4OpsChoice

    from .run_v4 import run_v4

    cfg = read_v4_config(ckpt)
    if settings.run.mtp and cfg.num_nextn_predict_layers < 1:
        raise click.ClickException(
            f"{ckpt}: run.mtp asks for the MTP draft layer, but this DeepSeek-V4 checkpoint has "
            f"none (config.json: num_nextn_predict_layers = {cfg.num_nextn_predict_layers}); "
            "use no --mtp")
    vocab = cfg.vocab_size
    token_lists = _prompts(settings.run.prompts, vocab, _prompts_source(prompts, config))
    check_output(report, "--report")
    check_output(save_logits, "--save-logits")
    if decode_tokens > 0:
        try:
            check_plugin_names(settings, transfer=True)
        except SettingsError as exc:
            raise click.ClickException(str(exc)) from exc
    run_v4(ckpt, token_lists, settings.cp.size, settings.cp.mode.value, settings.kv.page_size,
           settings.runtime.chunk_tokens, decode_tokens, output_console(), report, save_logits,
           device=settings.run.device, ops=V4OpsChoice.of(settings), settings=settings)


@click.command("run")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Settings TOML file (CPKV_* environment variables override it; flags override both).")
@click.option("--model", default=None, help="Checkpoint directory, or 'tiny' (run.model).")
@click.option("--cp", type=click.IntRange(min=1), default=None, help="CP group size (cp.size).")
@click.option("--mode", type=click.Choice([m.value for m in SplitMode]), default=None,
              help="Split mode (cp.mode).")
@click.option("--prompts", type=click.Path(dir_okay=False), default=None,
              help="JSON list of token-id lists (run.prompts).")
@click.option("--decode-tokens", type=click.IntRange(min=0), default=8, show_default=True,
              help="Greedy tokens per prompt on the decode rank after the transfer (0: no transfer "
                   "and decode phases).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default=None,
              help="cpu: Gloo ranks, float32 model; cuda: NCCL ranks (rank r on GPU r), bfloat16 "
                   "model, the reference on GPU 0 (with one GPU fewer than processes the decode "
                   "rank shares GPU 0: transfer mooncake); auto: cuda when there is a GPU per "
                   "process (run.device, default cpu).")
@click.option("--mtp/--no-mtp", default=None,
              help="Run the checkpoint's MTP draft layer under CP prefill and decode "
                   "speculatively (run.mtp).")
@click.option("--draft-tokens", type=click.IntRange(min=1, max=8), default=None,
              help="With --mtp: draft tokens verified per decode step (run.draft_tokens) [1].")
@click.option("--chunk", type=click.IntRange(min=0), default=None,
              help="Chunked prefill: prefill a prompt longer than N tokens in chunks of at most N "
                   "(a multiple of kv.page_size; 0: off) and list each chunk's time "
                   "(runtime.chunk_tokens).")
@click.option("--reference", type=click.Choice(["full", "sample", "off"]), default=None,
              help="The one-rank reference check: full (every prompt whole), sample (each prompt "
                   "up to run.reference_tokens) or off (run.reference).")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the report as JSON here.")
@click.option("--save-logits", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="torch.save the last-position logits, float32 [prompts, vocab], input order.")
@click.pass_obj
def command(state: CliState | None, config: Path | None, model: str | None, cp: int | None,
            mode: str | None, prompts: str | None, decode_tokens: int, device: str | None,
            mtp: bool | None, draft_tokens: int | None, chunk: int | None,
            reference: str | None, report: Path | None,
            save_logits: Path | None) -> None:
    """CP prefill of prompts on a CP group, transfer of the pages to a decode rank and greedy
    decoding there, checked against one rank; prints a report.

    Under torchrun each process is one rank (prefill ranks, then the decode rank): without
    --cp the CP size is the world size less the decode rank; rank 0 prints the report."""
    from cpkv.runtime.world import launched_world

    state = state or CliState()
    if draft_tokens is not None and mtp is not True:
        raise click.UsageError("--draft-tokens needs --mtp (it sets the draft tokens verified per "
                               "speculative decode step)")
    try:
        launched = launched_world()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if launched is not None:
        stop_at_once_on_signals(announce=launched[0] == 0)
    if launched is not None and cp is None:
        cp = launched[1] - (1 if decode_tokens > 0 else 0)
        if cp < 1:
            raise click.ClickException(f"torchrun started {launched[1]} process(es): the job needs "
                                       f"at least {2 if decode_tokens > 0 else 1}")
    over = _overrides(cp=cp, mode=mode, model=model, prompts=prompts, device=device, mtp=mtp,
                      draft_tokens=draft_tokens, chunk=chunk, reference=reference)
    settings, ckpt, sources = load_for_command(OPTIONS, over, config)
    cfg = _checkpoint_config(settings, ckpt)
    if cfg is None:  # DeepSeek-V4: its own prefill job (cli/run_v4.py)
        _run_v4(settings, ckpt, prompts, config, decode_tokens, report, save_logits)
        return
    vocab = cfg.vocab_size
    level = level_from_flags(state.verbose, state.quiet, settings.log.level)
    # the report lists every fallback: by default they are not logged as well
    hide = frozenset({"cpkv.fallback"}) if level > logging.INFO else frozenset()
    configure_logging(level, hide)
    engine_log_env(level)
    token_lists = _prompts(settings.run.prompts, vocab, _prompts_source(prompts, config))
    # before any rank starts: a run of minutes must not end in "cannot write there"
    check_output(report, "--report")
    check_output(save_logits, "--save-logits")
    try:  # before the heading: a misspelt plugin name is all the user sees
        check_plugin_names(settings, transfer=decode_tokens > 0)
    except SettingsError as exc:
        raise click.ClickException(sources.line(exc)) from exc
    need = settings.cp.size + (1 if decode_tokens > 0 else 0)
    if launched is not None and launched[1] != need:
        raise click.ClickException(f"torchrun started {launched[1]} processes; this job needs "
                                   f"{need} (cp.size = {settings.cp.size}"
                                   f"{' + the decode rank' if decode_tokens > 0 else ''})")
    console = output_console(quiet=launched is not None and launched[0] != 0)
    console.print(f"model {ckpt}, CP{settings.cp.size} {settings.cp.mode.value}, "
                  f"kv.dtype {settings.kv.dtype}, {len(token_lists)} prompts")
    # the spinner goes to stderr with the log: stdout holds the report alone
    err = Console(stderr=True, quiet=console.quiet)
    with err.status("starting") as status:
        # per batch and chunk: a status line on a terminal, a line every 10 s otherwise
        shown = ProgressLine(status.update if err.is_terminal else None,
                             decode_rank=settings.cp.size if decode_tokens > 0 else None,
                             quiet=level >= logging.ERROR)
        try:
            rep = run_job(settings, str(ckpt), token_lists, decode_tokens=decode_tokens,
                          batch_size=settings.run.batch_size, mtp=settings.run.mtp,
                          draft_tokens=settings.run.draft_tokens,
                          progress=lambda s: status.update(s),
                          log_setup=RankLogging(level, hide), on_progress=shown)
        except ValueError as exc:  # SettingsError (a plugin name) included
            raise click.ClickException(str(exc)) from exc
    if rep is None:  # a rank of a torchrun world other than 0: rank 0 reports
        return
    verdict = rep.verdict()
    _render(rep, verdict, console, settings.kv.pages_per_rank * settings.kv.page_size)
    if report:
        text = json.dumps({**rep.to_json(), "model": str(ckpt), "tolerance": verdict.tolerance,
                           # None: nothing was compared (run.reference = "off")
                           "correct": verdict.passed if verdict.checked else None,
                           **report_context(settings)},
                          indent=2) + "\n"
        _write("--report", report, lambda tmp: tmp.write_text(text))
    if save_logits:
        logits = rep.logits.float().contiguous()
        _write("--save-logits", save_logits, lambda tmp: torch.save(logits, tmp))
    if not verdict.passed:
        raise SystemExit(1)
