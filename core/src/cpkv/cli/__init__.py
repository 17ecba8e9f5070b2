"""The ``cpkv`` command. A thin layer over the library: every subcommand calls public API."""

from __future__ import annotations

import click

from cpkv.fallback import FallbackError

from ._logging import configure_logging

__all__ = ["main"]


class _Group(click.Group):
    """Turns errors users cause (a fallback refused by policy) into a one-line message."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except FallbackError as exc:
            raise click.ClickException(str(exc)) from exc


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="cpkv-core", prog_name="cpkv")
def main(verbose: int) -> None:
    """cpkv: page-aligned shared KV for context-parallel prefill."""
    configure_logging(verbose)


def _register() -> None:
    from . import bench, init_model, plan, plugins, run

    for mod in (bench, init_model, plan, plugins, run):
        main.add_command(mod.command)


_register()
