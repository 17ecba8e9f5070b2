"""Hook specifications of cpkv plugins (project name ``cpkv``).

A plugin is a module (or object) with functions marked ``@hookimpl``, reached through an entry
point in the ``cpkv.backends`` or ``cpkv.transfers`` group. An implementation may take fewer
arguments than its spec, so specs can grow without breaking plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from cpkv.contracts import FallbackEvent

    from .registry import BackendRegistrar, TransferRegistrar

PROJECT = "cpkv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    """Declare compute backends: call ``registrar.add(BackendSpec(...))`` once per backend.

    Must be cheap: no kernel builds, no heavy imports. Availability is decided later by the
    spec's ``probe`` and kernels are loaded by its ``load``.
    """


@hookspec
def cpkv_register_transfers(registrar: TransferRegistrar) -> None:
    """Declare KV transfer plugins: call ``registrar.add(TransferSpec(...))``."""


@hookspec
def cpkv_on_fallback(event: FallbackEvent) -> None:
    """Observe every fallback cpkv reports (after it is logged and counted). Return nothing."""
