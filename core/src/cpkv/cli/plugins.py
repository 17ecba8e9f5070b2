"""``cpkv plugins``: every discovered backend and transfer plugin and whether it can run."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cpkv.contracts import PluginInfo
from cpkv.plugin import PluginHost
from cpkv.settings import SettingsError, load_settings

from ._console import output_console
from ._errors import Sources

__all__ = ["command", "render_plugins"]


def render_plugins(infos: list[PluginInfo], console: Console) -> None:
    """The plugins as one rich table: what each provides, or precisely why it cannot run."""
    t = Table(title="cpkv plugins")
    for col in ("kind", "name", "distribution", "version", "available", "ops / reason"):
        t.add_column(col, overflow="fold")
    for i in infos:
        if i.availability.available:
            avail = "[green]yes[/]"
            what = ", ".join(i.ops) if i.ops else "(no ops yet)"
        else:
            avail = "[red]no[/]"
            what = i.availability.reason
        # a plugin's reason may hold brackets ("[cuda]"): print it as written, not as markup
        t.add_row(i.kind.value, escape(i.name), i.distribution, i.version, avail, escape(what))
    console.print(t)


@click.command("plugins")
@click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Settings TOML file (its [plugins] disable/allow apply).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the list of plugin descriptions as JSON.")
def command(config: Path | None, as_json: bool) -> None:
    """List discovered plugins and why any is unavailable.

    Exits 0 when some plugins are unavailable: that is information, not failure.
    """
    try:
        settings = load_settings(config)
    except SettingsError as exc:
        raise click.ClickException(Sources({}, {}, config).line(exc)) from exc
    host = PluginHost(disable=settings.plugins.disable, allow=settings.plugins.allow)
    try:
        infos = host.infos()
    finally:
        host.close()
    if as_json:
        click.echo(json.dumps([i.model_dump(mode="json") for i in infos], indent=2))
        return
    render_plugins(infos, output_console())
