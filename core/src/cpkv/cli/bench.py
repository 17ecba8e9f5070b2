"""``cpkv bench``: benchmarks that write JSON reports (rows with a same-run baseline)."""

from __future__ import annotations

import shlex
import sys

import click
from rich.console import Console
from rich.table import Table

from cpkv.bench import BenchReport, BenchRow, machine_description


def _show(rows: list[BenchRow]) -> None:
    t = Table(title="benchmark")
    for col in ("name", "value", "unit", "baseline", "ratio"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r.name, f"{r.value:.4g}", r.unit, f"{r.baseline_value:.4g} ({r.baseline_name})",
                  f"{r.ratio:.3g}")
    Console().print(t)


@click.group("bench")
def command() -> None:
    """Run benchmarks; each writes benchmarks/results/<name>.json."""


@command.command("plan")
@click.option("--out", type=click.Path(dir_okay=False), default="benchmarks/results/plan_cpu.json",
              show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True)
def plan_cmd(out: str, repeat: int) -> None:
    """Host time of the split planner on 256-request batches (both modes, CP2 and CP8)."""
    from cpkv.bench import plan

    err = Console(stderr=True)
    rows = plan.run(repeat=repeat, progress=lambda s: err.print(f"[dim]{s}[/]"))
    report = BenchReport(machine=machine_description(),
                         command="cpkv bench plan " + shlex.join(sys.argv[3:]), results=rows)
    _show(rows)
    click.echo(f"wrote {report.write(out)}")
