"""Declares the ``example`` backend (entry point ``cpkv.backends: example``).

Importing this module imports neither torch nor the ops: cpkv imports every plugin module at
discovery, also on machines where the backend will never run.

Two switches simulate failures, for tests and for the docs:

* ``EXAMPLE_BACKEND_UNAVAILABLE=1``: the probe says no (selection falls back with
  ``plugin_unavailable``);
* ``EXAMPLE_BACKEND_BROKEN=1``: importing this module raises ``ImportError`` (discovery lists the
  plugin as failed and selection falls back with ``plugin_load_failed``).

(Not ``CPKV_*`` names: cpkv's settings reject unknown ``CPKV_*`` variables.)
"""

from __future__ import annotations

import importlib.util
import os
from typing import cast

from cpkv.contracts import Availability, KVOps, Op
from cpkv.plugin import BackendRegistrar, BackendSpec, hookimpl

if os.environ.get("EXAMPLE_BACKEND_BROKEN") == "1":
    raise ImportError("cpkv_example_backend is broken on purpose (EXAMPLE_BACKEND_BROKEN=1)")

NAME = "example"
OPS: frozenset[Op] = frozenset({Op.RERANGE})


def probe() -> Availability:
    """Cheap: may the backend run here? Runs every check and names each failing one."""
    reasons = []
    if os.environ.get("EXAMPLE_BACKEND_UNAVAILABLE") == "1":
        reasons.append("EXAMPLE_BACKEND_UNAVAILABLE is set")
    if importlib.util.find_spec("torch") is None:  # test for it without importing it
        reasons.append("torch is not installed")
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> KVOps:
    """Import the op now (only when this backend is selected) and return the backend object."""
    from .ops import ExampleOps

    return cast(KVOps, ExampleOps())  # rerange only: only the ops in OPS are called


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=OPS, probe=probe, load=load,
                              description="example third-party backend (rerange only)"))
