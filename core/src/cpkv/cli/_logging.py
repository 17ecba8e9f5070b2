"""structlog setup for the CLI only (library code never configures structlog)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(verbose: int = 0) -> None:
    """Human-readable key=value events on stderr; warnings and up unless ``-v``."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
