"""``cpkv bench``: benchmarks that write JSON reports (rows with a same-run baseline)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from cpkv.bench import BenchReport, BenchRow, machine_description, results_name

from ._console import output_console


def _show(rows: list[BenchRow]) -> None:
    t = Table(title="benchmark")
    for col in ("name", "value", "unit", "baseline", "ratio"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r.name, f"{r.value:.4g}", r.unit, f"{r.baseline_value:.4g} ({r.baseline_name})",
                  f"{r.ratio:.3g}")
    output_console().print(t)


def _report(name: str, rows: list[BenchRow], out: str, detail: Mapping[str, object] | None = None,
            summary: str = "") -> None:
    """Show ``rows`` (and a summary line), write the JSON report of ``cpkv bench NAME`` to
    ``out`` with the machine and the command line, and say where. Without ``--out`` the report
    goes to the user cache dir under ``out``'s file name (:func:`bench_out`): the tracked
    ``benchmarks/results`` files change only when asked for by ``--out``."""
    out = bench_out(out)
    report = BenchReport(machine=machine_description(),
                         command=f"cpkv bench {name} " + shlex.join(sys.argv[3:]),
                         results=tuple(rows), detail=dict(detail or {}))
    _show(rows)
    if summary:
        click.echo(summary)
    click.echo(f"wrote {report.write(out)}")


def bench_out(out: str) -> str:
    """``out`` when ``--out`` was given, else its file name in ``$XDG_CACHE_HOME/cpkv/bench``
    (``~/.cache/cpkv/bench``)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.get_parameter_source("out") is not click.core.ParameterSource.DEFAULT:
        return out
    from cpkv.models.tiny import default_cache_dir

    return str(default_cache_dir().parent / "bench" / Path(out).name)


def _progress_console() -> Console:
    """Where a bench says what it is doing: stderr, on a terminal or with ``-v``; silent
    otherwise (at default verbosity a piped bench prints its result and the report's path only),
    and with ``-q``."""
    from ._state import CliState

    ctx = click.get_current_context(silent=True)
    state = ctx.find_object(CliState) if ctx is not None else None
    verbose, quiet = (state.verbose, state.quiet) if state is not None else (0, 0)
    return Console(stderr=True, quiet=bool(quiet) or not (verbose or sys.stderr.isatty()))


def _check_out(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--out`` (or, without it, the cache directory it defaults to) checked before the bench
    runs: one line naming the option when it cannot take the report."""
    from cpkv.models.tiny import default_cache_dir

    from ._outputs import check_output

    if ctx.get_parameter_source("out") is click.core.ParameterSource.DEFAULT or value is None:
        name = Path(value).name if value else "report.json"
        check_output(default_cache_dir().parent / "bench" / name, "--out (default)")
    else:
        check_output(value, "--out")
    return value


def _out_option(default: str | None, file: str = "") -> Any:
    """The benches' ``--out``: ``default`` is the tracked file it names (None: named after the
    card the bench runs on, ``<bench>_<card>.json`` (:func:`cpkv.bench.results_name`), ``file``
    says how), but without ``--out`` the report goes to the cache directory (:func:`bench_out`),
    which the help says; checked before the bench runs."""
    name = Path(default).name if default else file
    return click.option(
        "--out", type=click.Path(dir_okay=False), default=default, callback=_check_out,
        help=f"Write the JSON report here [default: ~/.cache/cpkv/bench/{name}; "
             f"benchmarks/results/{name} updates the tracked results].")


def _layers_option(default: int | None, help: str) -> Any:
    """The benches' ``--layers`` (at least 1; a default of None is the bench's own choice)."""
    return click.option("--layers", type=click.IntRange(min=1), default=default,
                        show_default=default is not None, help=help)


@click.group("bench")
@click.pass_context
def command(ctx: click.Context) -> None:
    """Run benchmarks; each writes a JSON report: to --out (benchmarks/results/<bench>_<card>.json
    to update the tracked results; <card> is cpu or the GPU's model, e.g. a100, with x2 for two
    GPUs), else to ~/.cache/cpkv/bench/<bench>_<card>.json."""
    import logging

    from ._logging import configure_logging, level_from_flags
    from ._state import CliState

    state = ctx.find_object(CliState) or CliState()
    level = level_from_flags(state.verbose, state.quiet)
    # a bench's fallbacks are part of what it measures (its JSON has the rows): logged from -v
    configure_logging(level, frozenset({"cpkv.fallback"}) if level > logging.INFO else frozenset())


@command.command("plan")
@_out_option("benchmarks/results/plan_cpu.json")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True)
def plan_cmd(out: str, repeat: int) -> None:
    """Host time of the split planner on 256-request batches (both modes, CP2 and CP8)."""
    from cpkv.bench import plan

    err = _progress_console()
    rows = plan.run(repeat=repeat, progress=lambda s: err.print(f"[dim]{s}[/]"))
    _report("plan", rows, out)


@command.command("cache")
@_out_option("benchmarks/results/cache_cpu.json")
@click.option("--cp", type=click.IntRange(min=1), default=2, show_default=True,
              help="CP ranks (Gloo processes).")
@click.option("--requests", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--prefix", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Shared prefix tokens (the issue's workload: 8192, ~25 min on 2 cores).")
@click.option("--suffix", type=click.IntRange(min=1), default=256, show_default=True,
              help="Distinct suffix tokens per request (the issue's workload: 512).")
@click.option("--page-size", type=click.IntRange(min=1), default=64, show_default=True)
def cache_cmd(out: str, cp: int, requests: int, prefix: int, suffix: int, page_size: int) -> None:
    """Prefix cache on CPU: shared prefix + distinct suffixes served one per batch, cache on vs
    off in the same ranks (tiny DeepSeek-V3.2, bf16 pool, torch ops); fails if logits differ."""
    import tempfile

    from cpkv.bench import cache
    from cpkv.models import write_tiny_checkpoint

    err = _progress_console()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0,
                                     max_position_embeddings=max(4096, prefix + suffix))
        settings = cache.bench_settings(cp, requests, prefix, suffix, page_size)
        rows, detail = cache.run(ckpt, settings, requests=requests, prefix=prefix, suffix=suffix,
                                 progress=lambda s: err.print(f"[dim]{s}[/]"))
    _report("cache", rows, out, detail,
            f"max relative error of the cached run's last-token logits: "
            f"{detail['max_rel_err']:.2e} (tolerance {detail['tolerance']:.0e})")
    if not detail["correct"] or not detail["hits_agree_across_ranks"]:
        raise click.ClickException(
            f"the cached run differs from the no-cache run: max relative logit error "
            f"{detail['max_rel_err']:.2e} > {detail['tolerance']:.0e}, or ranks disagree on hits "
            f"(hits_agree_across_ranks={detail['hits_agree_across_ranks']})")


@command.command("transfer")
@_out_option(None, "transfer_<card>.json")
@click.option("--plugins", default="nccl,mooncake", show_default=True,
              help="Transfer plugins, comma-separated (each its own run).")
@click.option("--tokens", default="8192,32768", show_default=True,
              help="Prompt lengths, comma-separated (e.g. 32768,131072).")
@click.option("--cp", type=click.IntRange(min=1), default=2, show_default=True,
              help="Prefill CP ranks (plus one decode rank).")
@_layers_option(16, "The model's layer count.")
@click.option("--preset", type=click.Choice(["tiny", "v32-attention"]), default="tiny",
              show_default=True, help="Model shape (cpkv init-model --preset).")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Timed rounds per prompt length (the medians are reported).")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option("--mooncake-protocol", default="tcp", show_default=True,
              help="transfer.mooncake.protocol of the mooncake runs, comma-separated (one run "
                   "each): tcp, rdma, nvlink (multi-node) or nvlink_intra (GPUs of one host).")
@click.option("--mooncake-stage", type=click.Choice(["auto", "host", "none"]), default="auto",
              show_default=True,
              help="transfer.mooncake.stage of the mooncake runs: sender-side pinned host staging.")
@click.option("--gpus", is_flag=True,
              help="NCCL world, rank r on cuda:r (prefill on cuda:0.., decode on the next GPU); "
                   "adds each plugin's GB/s against a raw cuda:0 -> cuda:1 copy.")
def transfer_cmd(out: str | None, plugins: str, tokens: str, cp: int, layers: int, preset: str,
                 repeats: int, kv_dtype: str, mooncake_protocol: str, mooncake_stage: str,
                 gpus: bool) -> None:
    """Prefill -> decode transfer: time to ready (prefill start -> decode published) with
    transfer.pipeline = "layer" vs "request" vs the prefill alone, per plugin, same run."""
    import tempfile

    from cpkv.bench import transfer
    from cpkv.models import write_tiny_checkpoint
    from cpkv.models.tiny import PRESETS

    err = _progress_console()
    sizes = [int(t) for t in tokens.split(",") if t.strip()]
    names = [p.strip() for p in plugins.split(",") if p.strip()]
    protocols = [p.strip() for p in mooncake_protocol.split(",") if p.strip()]
    known = ("tcp", "rdma", "nvlink", "nvlink_intra")
    if not protocols or any(p not in known for p in protocols):
        raise click.BadParameter(f"{mooncake_protocol!r}: each of {', '.join(known)}",
                                 param_hint="--mooncake-protocol")
    rows: list[BenchRow] = []
    detail: dict[str, object] = {"layers": layers, "preset": preset,
                                 "mooncake_protocol": mooncake_protocol,
                                 "mooncake_stage": mooncake_stage}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {**PRESETS[preset], "num_hidden_layers": layers}
        cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings", 4096)),
                                             max(sizes) + 1024)
        if preset == "v32-attention":
            cfg["first_k_dense_replace"] = layers
        ckpt = write_tiny_checkpoint(Path(tmp) / "model", seed=0, **cfg)
        runs = [(name, p) for name in names for p in (protocols if name == "mooncake"
                                                       else ["tcp"])]
        for name, proto in runs:
            settings = transfer.bench_settings(cp, name, sizes, kv_dtype=kv_dtype,
                                               protocol=proto, stage=mooncake_stage)
            label = transfer.run_label(name, proto)
            r, d = transfer.run(ckpt, settings, tokens=sizes, repeats=repeats, gpus=gpus,
                                progress=lambda s: err.print(f"[dim]{s}[/]"), label=label)
            rows += r
            # one protocol: keyed by the plugin as before; several: by plugin_protocol
            detail[name if len(protocols) == 1 or name != "mooncake" else label] = d
    _report("transfer", rows, out or results_name("transfer", 2 if gpus else 1), detail)


@command.command("host")
@_out_option(None, "host_<card>.json")
@click.option("--pages", type=click.IntRange(min=1), default=None,
              help="Pages per layer moved (default: 1024 on a GPU, 128 on a CPU).")
@_layers_option(None, "Layers (default: 4 on a GPU, 2 on a CPU).")
@click.option("--device", default=None,
              help="torch device (default: cuda when available, else cpu).")
def host_cmd(out: str | None, pages: int | None, layers: int | None, device: str | None) -> None:
    """Host tier reload (host -> device) and save (device -> host) of scattered fp8
    DeepSeek-V3.2 pages vs one contiguous pinned copy of the same bytes; fails unless the
    round trip is bit exact."""
    import torch

    from cpkv.bench import host

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise click.ClickException(f"--device {dev}: no CUDA device is available")
    pages = pages or (1024 if cuda else 128)
    layers = layers or (4 if cuda else 2)
    out = out or (results_name("host") if cuda else "benchmarks/results/host_cpu.json")
    err = _progress_console()
    try:
        rows, detail = host.run(dev, pages, layers, progress=lambda s: err.print(f"[dim]{s}[/]"))
    except host.RoundTripError as e:
        raise click.ClickException(str(e)) from e
    _report("host", rows, out, detail,
            f"{detail['bytes_per_token']} B per token, {detail['page_bytes']} B per page, "
            f"{pages} pages x {layers} layers; bit exact: {detail['bit_exact']}")
    if not detail["bit_exact"]:
        raise click.ClickException("the host tier round trip is not bit exact")




@command.command("mtp")
@_out_option(None, "mtp_<card>.json")
@click.option("--tokens", type=click.IntRange(min=8), default=None,
              help="Prompt of the CP2 draft prefill memory run (default: 65536 on GPUs, 2048 on "
                   "CPUs).")
@click.option("--prompts", default=None,
              help="Prompt lengths of the decode run, comma-separated (default: 4 x 1024 on GPUs, "
                   "2 x 96 on CPUs).")
@click.option("--decode-tokens", type=click.IntRange(min=2), default=None,
              help="Greedy tokens per prompt (default: 64 on GPUs, 16 on CPUs).")
@click.option("--draft-tokens", type=click.IntRange(min=1, max=8), default=1, show_default=True,
              help="Drafts verified per speculative step (k).")
@_layers_option(None, "Target layers (default: 2 at DeepSeek-V3.2's attention sizes on GPUs; the "
                   "tiny model's 3 on CPUs).")
@click.option("--backends", default="cuda,triton,torch", show_default=True,
              help="backend.preference (comma-separated).")
def mtp_cmd(out: str | None, tokens: int | None, prompts: str | None, decode_tokens: int | None,
            draft_tokens: int, layers: int | None, backends: str) -> None:
    """The MTP draft layer: peak memory of CP2 draft prefill with local vs full-prompt
    embedding (rule 32), and decode tokens/s with vs without speculative decoding (one
    checkpoint whose draft agrees with the target); fails if the tokens differ."""
    import tempfile

    import torch

    from cpkv.bench import mtp
    from cpkv.models import write_tiny_checkpoint

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    tokens = tokens or (65536 if gpu else 2048)
    lens = tuple(int(x) for x in prompts.split(",")) if prompts else (
        (1024,) * 4 if gpu else (96, 96))
    decode_tokens = decode_tokens or (64 if gpu else 16)
    out = out or (results_name("mtp", 2) if gpu else "benchmarks/results/mtp_cpu.json")
    over = mtp.agree_config(tokens, layers, gpu)
    err = _progress_console()
    with tempfile.TemporaryDirectory() as tmp:
        err.print("[dim]writing a checkpoint whose MTP layer agrees with its target[/]")
        ckpt = str(write_tiny_checkpoint(Path(tmp) / "agree", seed=0, draft="agree", **over))
        rows, detail = mtp.run(ckpt, ckpt, tokens=tokens, prompt_lens=lens,
                               decode_tokens=decode_tokens, draft_tokens=draft_tokens,
                               kv_dtype="fp8" if gpu else "bf16",
                               backends=tuple(b for b in backends.split(",") if b), gpu=gpu,
                               progress=lambda s: err.print(f"[dim]{s}[/]"))
    st = detail["decode"]["speculative"]["stats"]
    _report("mtp", rows, out, detail,
            f"speculative decoding: accept rate {st['accept_rate']:.1%}, mean accepted length "
            f"{st['mean_accepted_length']:.2f}, {st['steps']} steps instead of {st['plain_steps']}"
            f"; tokens equal plain greedy: {detail['decode']['tokens_match']}")
    if not detail["decode"]["tokens_match"]:
        raise click.ClickException("speculative decoding's tokens differ from plain greedy's")


@command.command("gpu")
@_out_option(None, "gpu_<card>.json")
@click.option("--sizes", default="16384,65536,131072", show_default=True,
              help="Prompt lengths for CP2 vs CP1 prefill.")
@_layers_option(2, "Decoder layers of the prefill stack (DeepSeek-V3.2's attention sizes).")
@click.option("--skip-prefill", is_flag=True, help="Kernels and materialization only.")
@click.option("--prefetch-prefix", type=click.IntRange(min=0), default=65536, show_default=True,
              help="Cached prefix of the prefetch measurement (0 skips it).")
@click.option("--materialize", type=click.Choice(["all_gather", "p2p", "auto"]), default="auto",
              show_default=True, help="kv.materialize of the CP2 vs CP1 prefill runs.")
@click.option("--backends", default="cuda,triton,torch", show_default=True,
              help="backend.preference of the CP2 vs CP1 prefill runs (comma-separated).")
def gpu_cmd(out: str | None, sizes: str, layers: int, skip_prefill: bool, prefetch_prefix: int,
            materialize: str, backends: str) -> None:
    """Kernels vs ceilings, materialization vs raw all-gather, CP2 vs CP1 prefill (needs GPUs)."""
    import torch

    from cpkv.bench import gpu

    if not torch.cuda.is_available():
        raise click.ClickException("cpkv bench gpu needs a CUDA device")
    err = _progress_console()
    opts = gpu.GpuBenchOptions(sizes=_ints(sizes), layers=layers, skip_prefill=skip_prefill,
                               prefetch_prefix=prefetch_prefix, materialize=materialize,
                               backends=tuple(b for b in backends.split(",") if b))
    rows, detail = gpu.run(opts, progress=lambda s: err.print(f"[dim]{s}[/]"))
    # the CP2 rows need two GPUs: the report is named after the GPUs the bench could use
    _report("gpu", rows, out or results_name("gpu", min(torch.cuda.device_count(), 2)), detail)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


@command.command("long")
@_out_option(None, "long{,_glm5}_<card>.json")
@click.option("--tokens", default="262144,524288,1048576", show_default=True,
              help="Prompt lengths (comma-separated; empty: the recall only).")
@click.option("--chunks", default="65536,131072", show_default=True,
              help="Chunk sizes each prompt is prefilled in (comma-separated).")
@_layers_option(2, "Decoder layers of the stack (each at the preset's attention sizes, dense "
                   "MLP); MFU counts the FLOPs of all of them.")
@click.option("--budget-mb", type=click.IntRange(min=1), default=None,
              help="runtime.logits_budget_mb of the runs (default: the settings' default).")
@click.option("--fixed-budget-mb", type=click.IntRange(min=0), default=512, show_default=True,
              help="Also the longest prompt in the smallest chunks at this fixed budget (peak "
                   "memory; 0 skips it).")
@click.option("--recall-tokens", default="4096,16384,65536,131072", show_default=True,
              help="Prompt lengths of the fp8-vs-bf16 indexer top-k overlap on the same layer "
                   "inputs (empty skips it).")
@click.option("--hf/--no-hf", default=True, show_default=True,
              help="The overlap also on a checkpoint written by transformers.")
@click.option("--hf-tokens", type=click.IntRange(min=0), default=4096, show_default=True,
              help="Prompt length of the last-token logits against transformers' own forward "
                   "pass on that checkpoint (0 skips it).")
@click.option("--bf16-compare/--no-bf16-compare", default=True, show_default=True,
              help="Where the defaults take the fp8 indexer, the prompts again with the bf16 "
                   "indexer (smallest chunks): the long_<n>_mfu and default_vs_bf16 rows.")
@click.option("--preset", type=click.Choice(["v32-attention", "glm5-attention",
                                           "v4-flash-attention", "v4-pro-attention"]),
              default="v32-attention", show_default=True,
              help="The stack (cpkv init-model --preset): glm5-attention alternates full and "
                   "shared-indexer layers; its rows are named glm5_long_..., its report "
                   "long_glm5_<card>.json. v4-flash-attention / v4-pro-attention: DeepSeek-V4's "
                   "CSA and HCA layers in bf16, each --tokens length in chunks of the smallest "
                   "--chunks (MFU, the indexer / compressor / attention seconds, peak memory, "
                   "KV bytes per token against V3.2's; the V3.2 options do not apply): report "
                   "long_v4flash_<card>.json / long_v4pro_<card>.json.")
def long_cmd(out: str | None, tokens: str, chunks: str, layers: int, budget_mb: int | None,
             fixed_budget_mb: int, recall_tokens: str, hf: bool, hf_tokens: int,
             bf16_compare: bool, preset: str) -> None:
    """Long prompts in chunks on one GPU with the default numerics: MFU, the speedup over the
    bf16 indexer, the top-k's share, peak memory, the fp8 indexer's top-k overlap with bf16's
    on the same layer inputs, last-token logits against transformers."""
    import torch

    from cpkv.bench import long

    from ._progress import ProgressLine

    if not torch.cuda.is_available():
        raise click.ClickException("cpkv bench long needs a CUDA device")
    err = _progress_console()
    if preset.startswith("v4-"):
        from cpkv.bench.long_v4 import V4_PRESETS, run_v4_long

        rows, detail, summary = run_v4_long(preset, _ints(tokens), min(_ints(chunks)),
                                            progress=lambda s: err.print(f"[dim]{s}[/]"))
        name = "long_" + V4_PRESETS[preset].rstrip("_")
        _report("long", rows, out or results_name(name), detail, summary)
        return
    opts = long.LongBenchOptions(tokens=_ints(tokens), chunks=_ints(chunks), layers=layers,
                                 budget_mb=budget_mb, fixed_budget_mb=fixed_budget_mb,
                                 recall_tokens=_ints(recall_tokens), hf=hf, hf_tokens=hf_tokens,
                                 bf16_compare=bf16_compare, preset=preset)
    shown = ProgressLine(None, quiet=err.quiet)  # a line per chunk at most every 10 s
    rows, detail, summary = long.run(opts, progress=lambda s: err.print(f"[dim]{s}[/]"),
                                     on_progress=shown)
    name = "long" if preset == "v32-attention" else "long_glm5"
    _report("long", rows, out or results_name(name), detail, summary)


@command.command("decode")
@_out_option(None, "decode_<card>.json")
@click.option("--batches", default="1,8,64", show_default=True,
              help="Requests per decode step (comma-separated).")
@click.option("--contexts", default="4096,65536,131072", show_default=True,
              help="Tokens of KV each request holds (comma-separated).")
@click.option("--steps", type=click.IntRange(min=3), default=30, show_default=True,
              help="Timed steps per run (median).")
@_layers_option(2, "Decoder layers of the stack (DeepSeek-V3.2's attention sizes).")
@click.option("--mtp/--no-mtp", default=True, show_default=True,
              help="Also speculative decoding (k = 1, 2) on the stack with an agreeing MTP layer.")
def decode_cmd(out: str | None, batches: str, contexts: str, steps: int, layers: int, mtp: bool) -> None:
    """Decode steps on one GPU: CUDA graphs vs eager, wall time over GPU time, tokens/s."""
    import tempfile

    import torch

    from cpkv.bench import decode
    from cpkv.bench.gpu import v32_stack
    from cpkv.models import write_tiny_checkpoint
    from cpkv.runtime import run_ranks

    if not torch.cuda.is_available():
        raise click.ClickException("cpkv bench decode needs a CUDA device")
    ctxs = _ints(contexts)
    positions = max(ctxs) + 4096  # the steps' tokens past the context
    tmp = Path(tempfile.mkdtemp())
    ckpt = str(write_tiny_checkpoint(tmp / "stack", seed=0,
                                     **v32_stack(layers, positions, num_nextn_predict_layers=0)))
    agree = None
    if mtp:
        agree = str(write_tiny_checkpoint(tmp / "agree", seed=0, draft="agree",
                                          **v32_stack(layers, positions,
                                                      num_nextn_predict_layers=1)))
    spec = decode.DecodeBenchSpec(ckpt, _ints(batches), ctxs, steps, mtp_model_dir=agree)
    Console(stderr=True).print(f"[dim]{layers}-layer stack: batches {spec.batches} at "
                               f"contexts {spec.contexts}, graphs and eager[/]")
    res = run_ranks(decode.decode_bench_rank, 1, args=(spec,), backend="nccl",
                    timeout_s=3600)[0].value
    _report("decode", decode.decode_rows(res), out or results_name("decode"), res)
