"""``cpkv run``: the main job.

Until CP prefill lands (issue #4) it loads the settings, lists the plugins and the backend each
op would run on, and prints the split plan of a sample batch on the configured CP group.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from cpkv.contracts import SplitMode
from cpkv.fallback import recording
from cpkv.planning import PlanError, plan_batch
from cpkv.plugin import PluginHost
from cpkv.settings import SettingsError, load_settings

from .plan import build_specs, render_plan
from .plugins import render_plugins

#: three prompts of different lengths: a long one, one after a cached prefix ending mid-page,
#: and a short extend (which takes the visible token-balanced fallback in zigzag mode)
SAMPLE_EXTEND = [1010, 600, 7]
SAMPLE_PREFIX = [0, 70, 0]


@click.command("run")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Settings TOML file (CPKV_* environment variables override it).")
@click.option("--cp", type=click.IntRange(min=1), default=None, help="CP group size (cp.size).")
@click.option("--mode", type=click.Choice([m.value for m in SplitMode]), default=None,
              help="Split mode (cp.mode).")
def command(config: Path | None, cp: int | None, mode: str | None) -> None:
    """Run the main job on the configured CP group (today: plugins and a sample plan)."""
    overrides = {k: v for k, v in {"size": cp, "mode": mode}.items() if v is not None}
    try:
        settings = load_settings(config, **({"cp": overrides} if overrides else {}))
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    console = Console()
    host = PluginHost(disable=settings.plugins.disable, allow=settings.plugins.allow)
    try:
        render_plugins(host.infos(), console)
    finally:
        host.close()
    c, ps = settings.cp.size, settings.kv.page_size
    with recording(settings.fallback.policy) as rec:
        try:
            plan = plan_batch(build_specs(SAMPLE_EXTEND, SAMPLE_PREFIX, "interleave", c, ps), c,
                              ps, settings.cp.mode)
        except PlanError as exc:
            raise click.ClickException(str(exc)) from exc
    render_plan(plan, console)
    console.print(f"fallbacks: {len(rec.events)} "
                  + ", ".join(f"{e.op}: {e.reason.value}" for e in rec.events))
    console.print("[dim]CP prefill on a model lands with issue #4; this run shows the plan only.[/]")
