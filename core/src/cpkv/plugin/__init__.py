"""cpkv's plugin system: hookspecs, entry-point discovery, registries with preference order.

Writing a plugin::

    # my_backend/plugin.py  (entry point:  [project.entry-points."cpkv.backends"] mine = "my_backend.plugin")
    from cpkv.plugin import BackendSpec, hookimpl
    from cpkv.contracts import Availability, Op

    @hookimpl
    def cpkv_register_backends(registrar):
        registrar.add(BackendSpec(name="mine", ops=frozenset({Op.RERANGE}),
                                  probe=Availability.yes, load=lambda: MyOps()))
"""

from .manager import GROUPS, Discovered, PluginHost
from .probes import cuda_device_missing
from .registry import (
    AgreeFn,
    BackendRegistrar,
    BackendRegistry,
    BackendSpec,
    Registry,
    Selection,
    TransferRegistrar,
    TransferRegistry,
    TransferSpec,
)
from .spec import hookimpl, hookspec

__all__ = [
    "GROUPS",
    "AgreeFn",
    "BackendRegistrar",
    "BackendRegistry",
    "BackendSpec",
    "Discovered",
    "PluginHost",
    "Registry",
    "Selection",
    "TransferRegistrar",
    "TransferRegistry",
    "TransferSpec",
    "cuda_device_missing",
    "hookimpl",
    "hookspec",
]
