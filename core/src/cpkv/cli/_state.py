"""The ``cpkv`` group's options, handed to the subcommands (``ctx.obj``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CliState"]


@dataclass
class CliState:
    """The group's options, for the subcommands (``ctx.obj``)."""

    verbose: int = 0
    quiet: int = 0
    debug: bool = False

    @property
    def tracebacks(self) -> bool:
        """Show tracebacks of errors: ``--debug`` or ``-v``."""
        return self.debug or self.verbose > 0
