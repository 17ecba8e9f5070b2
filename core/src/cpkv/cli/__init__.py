"""The ``cpkv`` command. A thin layer over the library: every subcommand calls public API."""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from types import FrameType

import click

from cpkv.runtime import RankFailed

from ._console import help_width
from ._errors import one_line
from ._logging import configure_logging, level_from_flags
from ._state import CliState

__all__ = ["CliState", "main"]

#: exit status after Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130


class _Group(click.Group):
    """Turns errors users cause (a fallback refused by policy, a rank's error) into one line with
    the fix, exit 1; Ctrl-C into exit 130. ``-v``/``--debug`` print the traceback first."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.BadParameter as exc:
            # a value the user gave (--cp 0, a bad --extend) is one line, exit 1; click's usage
            # block stays for malformed command lines (an unknown option, a missing argument)
            raise click.ClickException(_bad_value(exc)) from None
        except KeyboardInterrupt:
            click.echo("cpkv: interrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:
            if isinstance(exc, click.ClickException | click.exceptions.Exit | click.Abort):
                raise
            line = one_line(exc)
            if line is None:
                raise  # a bug: its traceback is what helps
            state = ctx.find_object(CliState)
            if state is not None and state.tracebacks:
                click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
                if isinstance(exc, RankFailed) and exc.traceback_text:
                    click.echo(f"--- traceback of {exc.label} ---\n{exc.traceback_text.rstrip()}",
                               err=True)
            elif isinstance(exc, RankFailed):
                line += " (-v shows the traceback)"
            raise click.ClickException(line) from exc


def _bad_value(exc: click.BadParameter) -> str:
    """``--cp 0: 0 is not in the range x>=1 (cpkv run --help lists the options)``."""
    hint = exc.param_hint if isinstance(exc.param_hint, str) else None
    if hint is None and exc.param is not None:
        hint = "/".join(getattr(exc.param, "opts", None) or [str(exc.param.name)])
    cmd = exc.ctx.command_path if exc.ctx is not None else "cpkv"
    return f"{hint or 'a value'}: {exc.message} ({cmd} --help lists the options)"


def _terminated(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds through the launcher's cleanup (it terminates the ranks)
    raise SystemExit(128 + signum)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], **help_width()})
@click.option("-v", "--verbose", count=True,
              help="More log output (-v info, -vv debug), every rank's events; tracebacks of errors.")
@click.option("-q", "--quiet", count=True, help="Errors only (no warnings).")
@click.option("--debug", is_flag=True, help="Show the traceback of an error (the log level stays).")
@click.version_option(package_name="cpkv-core", prog_name="cpkv")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: int, debug: bool) -> None:
    """cpkv: page-aligned shared KV for context-parallel prefill."""
    ctx.obj = CliState(verbose=verbose, quiet=quiet, debug=debug)
    configure_logging(level_from_flags(verbose, quiet))
    if sys.platform != "win32" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def _register() -> None:
    from . import bench, init_model, plan, plugins, run, warmup

    for mod in (bench, init_model, plan, plugins, run, warmup):
        main.add_command(mod.command)


_register()
