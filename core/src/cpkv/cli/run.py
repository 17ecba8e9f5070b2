"""``cpkv run``: the main job.

Until CP prefill of a model lands (issue #4), the main job runs the sharded KV pool on a real CP
group (C processes, Gloo on CPU): a sample batch of three prompts of different lengths, then a
second batch that continues one of them from a prefix ending mid-page. Every rank checks its full
view against a replicated pool and the packed truth, bit for bit, and reports its KV bytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from cpkv.contracts import KVFormat, SplitMode
from cpkv.runtime import RankFailed, RankTimeout, run_ranks
from cpkv.settings import SettingsError, load_settings
from cpkv.testing.pool_check import PoolScenario, run_pool_scenario

#: three prompts of different lengths (the last one a short extend), then a continuation of the
#: second from its mid-page end
SAMPLE_BATCHES = ((("p0", 1010), ("p1", 600), ("p2", 7)), (("p1", 300),))


@click.command("run")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Settings TOML file (CPKV_* environment variables override it).")
@click.option("--cp", type=click.IntRange(min=1), default=None, help="CP group size (cp.size).")
@click.option("--mode", type=click.Choice([m.value for m in SplitMode]), default=None,
              help="Split mode (cp.mode).")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the report as JSON here.")
def command(config: Path | None, cp: int | None, mode: str | None, layers: int,
            report: Path | None) -> None:
    """Run the sharded KV pool on a CP group and report KV bytes per rank vs a replica."""
    overrides = {k: v for k, v in {"size": cp, "mode": mode}.items() if v is not None}
    try:
        settings = load_settings(config, **({"cp": overrides} if overrides else {}))
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    c = settings.cp.size
    fmt = KVFormat.deepseek_v32(settings.kv.dtype, settings.kv.page_size)
    sc = PoolScenario(batches=SAMPLE_BATCHES, fmt=fmt, mode=settings.cp.mode, num_layers=layers,
                      pages_per_rank=settings.kv.pages_per_rank, debug=settings.debug,
                      preference=tuple(settings.backend.effective_preference()))
    console = Console()
    start = time.perf_counter()
    with console.status(f"running {c} ranks ({settings.cp.mode.value}, {fmt.dtype.value} pool, "
                        f"{layers} layers)..."):
        try:
            results = run_ranks(run_pool_scenario, c, args=(sc,),
                                timeout_s=settings.runtime.timeout_s,
                                fallback_policy=settings.fallback.policy)
        except RankFailed as exc:
            if exc.error_type.endswith("FallbackError"):  # policy "error": the reason is enough
                raise click.ClickException(f"rank {exc.rank}: {exc.error_message}") from exc
            raise click.ClickException(str(exc)) from exc
        except RankTimeout as exc:
            raise click.ClickException(str(exc)) from exc
    wall = time.perf_counter() - start
    outs = [r.value for r in results]
    replicated = outs[0].logical_bytes
    t = Table(title=f"KV per rank: CP{c} {settings.cp.mode.value}, {fmt.dtype.value} pool, "
                    f"{layers} layers")
    for col in ("rank", "KV bytes", "vs replicated", "prepare s", "write s", "materialize s"):
        t.add_column(col, justify="right")
    for o in outs:
        t.add_row(str(o.rank), f"{o.bytes_held:,}", f"{o.bytes_held / replicated:.1%}",
                  f"{o.seconds_prepare:.3f}", f"{o.seconds_write:.3f}",
                  f"{o.seconds_materialize:.3f}")
    console.print(t)
    console.print(f"replicated pool: {replicated:,} bytes on every rank; sharded total "
                  f"{sum(o.bytes_held for o in outs):,}")
    events = [(r.rank, e) for r in results for e in r.fallbacks]
    for rank, e in events:
        if rank == 0:
            console.print(f"[yellow]fallback[/] {e.op}: {e.requested} -> {e.selected} "
                          f"({e.reason.value})")
    mismatches = [m for o in outs for m in o.mismatches]
    ok = not mismatches
    console.print(("[green]correct[/]: every rank's full view equals the replicated pool's, bit "
                   "for bit") if ok else f"[red]MISMATCH[/]: {mismatches[:5]}")
    console.print(f"wall time {wall:.1f} s")
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({
            "cp": c, "mode": settings.cp.mode.value, "kv_dtype": fmt.dtype.value,
            "kv_bytes_per_rank": [o.bytes_held for o in outs],
            "kv_bytes_replicated": replicated,
            "full_view_matches_replicated": ok,
            "fallbacks": [dict(rank=rank, **e.model_dump(mode="json")) for rank, e in events],
            "seconds": wall,
        }, indent=2) + "\n")
    if not ok:
        raise SystemExit(1)
