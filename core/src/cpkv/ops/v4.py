"""DeepSeek-V4's op table: :data:`~cpkv.ops.table.V4_OPS` resolved through the registry (a
:class:`~cpkv.models.deepseek_v4.DeepseekV4` runs its ``v4_*`` ops on it)."""

from __future__ import annotations

from collections.abc import Sequence

from cpkv.plugin import AgreeFn, PluginHost

from .table import V4_OPS, OpTable

__all__ = ["v4_op_table"]


def v4_op_table(preference: Sequence[str] = ("torch",), agree: AgreeFn | None = None,
                device_type: str | None = None, quiet: bool = False,
                disable: Sequence[str] = (), allow: Sequence[str] | None = None) -> OpTable:
    """The ``v4_*`` ops from the first backend of ``preference`` that provides each (every
    step away from ``preference[0]`` is a reported fallback: the Triton and CUDA backends do
    not provide them, so a run that asks for one runs them on ``torch``, visibly).

    ``agree``: the group's agreement (all ranks choose alike); ``device_type``: the run's
    tensors' device type; ``quiet``: the preference is the default order (``backend.name =
    "auto"``); ``disable`` / ``allow``: the settings' ``plugins.*``.

    Raises:
        LookupError: no backend of ``preference`` provides an op.
    """
    host = PluginHost(disable=disable, allow=allow)
    try:
        return OpTable.resolve(host.backends(), preference, V4_OPS, agree=agree,
                               device_type=device_type, quiet=quiet)
    finally:
        host.close()
