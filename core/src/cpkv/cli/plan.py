"""``cpkv plan``: print the split plan of a batch as a table or as JSON."""

from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.table import Table

from cpkv.contracts import CPPlan, OwnerMap, RequestSpec, SplitMode, cdiv
from cpkv.planning import PlanError, plan_batch

from ._console import output_console


def _ints(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if any(v < 0 for v in out):
        raise click.BadParameter(f"lengths must be >= 0, got {value!r}")
    return out


def build_specs(
    extend: list[int], prefix: list[int] | None, prefix_owner: str, cp: int, page_size: int
) -> list[RequestSpec]:
    """Request specs for the CLI's lengths; prefix pages owned round-robin or all on rank 0."""
    prefix = prefix or [0] * len(extend)
    if len(prefix) != len(extend):
        raise click.BadParameter(f"--prefix has {len(prefix)} values, --extend has {len(extend)}")
    specs = []
    for p, e in zip(prefix, extend, strict=True):
        n = cdiv(p, page_size)
        owners = (OwnerMap.interleaved(n, cp) if prefix_owner == "interleave"
                  else OwnerMap.on_rank(n, cp, 0)).owners
        specs.append(RequestSpec(prefix_len=p, extend_len=e, prefix_owners=owners))
    return specs


def render_plan(plan: CPPlan, console: Console) -> None:
    """The plan as two rich tables: requests with their segments, then rows per rank."""
    t = Table(title=f"CP{plan.cp_size} {plan.mode.value} plan, {plan.page_size}-token pages")
    for col in ("req", "P", "E", "page-aligned", "segments [start, end) -> rank", "page owners"):
        t.add_column(col, overflow="fold")
    for i, r in enumerate(plan.requests):
        segs = " ".join(f"[{s.start},{s.end})->{s.rank}" for s in r.segments)
        owners = "".join("." if o is None else str(o) for o in r.page_owners)
        aligned = "yes" if r.page_aligned else f"[yellow]no ({r.fallback})[/]"
        t.add_row(str(i), str(r.prefix_len), str(r.extend_len), aligned, segs, owners)
    console.print(t)
    rt = Table(title="rows per rank")
    rt.add_column("rank")
    rt.add_column("rows", justify="right")
    rt.add_column("share", justify="right")
    for rank, n in enumerate(plan.rank_counts):
        rt.add_row(str(rank), str(n), f"{n / max(1, plan.num_tokens):.1%}")
    console.print(rt)
    console.print(f"max_rank_len = {plan.max_rank_len}")


@click.command("plan")
@click.option("--cp", "cp", type=click.IntRange(min=1), required=True, help="CP group size C.")
@click.option("--page-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--mode", type=click.Choice([m.value for m in SplitMode]), default="zigzag",
              show_default=True)
@click.option("--extend", callback=_ints, required=True, help="Extend lengths E1,E2,...")
@click.option("--prefix", callback=_ints, default=None, help="Cached prefix lengths P1,P2,...")
@click.option("--prefix-owner", type=click.Choice(["interleave", "rank0"]), default="interleave",
              show_default=True, help="How cached prefix pages are owned: page k on rank k mod C, "
              "or all on rank 0.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan model as JSON.")
def command(cp: int, page_size: int, mode: str, extend: list[int], prefix: list[int] | None,
            prefix_owner: str, as_json: bool) -> None:
    """Print the split plan of a batch (fallbacks are reported on stderr)."""
    if not extend or any(e < 1 for e in extend):
        raise click.BadParameter(f"every extend length must be >= 1, got {extend}",
                                 param_hint="--extend")
    try:
        plan = plan_batch(build_specs(extend, prefix, prefix_owner, cp, page_size), cp, page_size,
                          mode)
    except PlanError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        sys.stdout.write(plan.model_dump_json(indent=2) + "\n")
    else:
        render_plan(plan, output_console())
