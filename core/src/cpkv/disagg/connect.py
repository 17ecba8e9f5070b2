"""Choosing a transfer plugin and joining a transfer, from the run's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpkv.kv import ShardedKVPool
from cpkv.plugin import AgreeFn, PluginHost

from .buffers import registered_buffers
from .transport import Link, LinkSpec, Transport

if TYPE_CHECKING:
    from cpkv.settings import Settings

__all__ = ["open_link", "select_transport"]


def select_transport(settings: Settings, agree: AgreeFn) -> Transport:
    """The transfer plugin ``settings.transfer.name``, selected alike on every endpoint
    (``agree`` combines every endpoint's availability, e.g. ``CPGroup.agree_all`` over the world
    of C + 1 processes).

    Raises:
        LookupError: no such plugin, or it is unavailable on some endpoint (its reason).
        TypeError: the plugin's ``load()`` returned something that is not a :class:`Transport`.
    """
    host = PluginHost(disable=settings.plugins.disable, allow=settings.plugins.allow)
    try:
        impl = host.transfers().select([settings.transfer.name], agree=agree)["transfer"].impl
    finally:
        host.close()
    if not isinstance(impl, Transport):
        raise TypeError(f"transfer plugin {settings.transfer.name!r} loaded {impl!r}, which is not a "
                        f"cpkv.disagg.Transport (needs a name and connect(LinkSpec) -> Link)")
    return impl


def open_link(transport: Transport, settings: Settings, *, endpoint: int, cp_size: int,
              pool: ShardedKVPool, world_ranks: tuple[int, ...] | None = None) -> Link:
    """Join a transfer as ``endpoint`` (0..C-1: prefill CP rank, C: the decode rank) with this
    endpoint's ``pool``: a collective over all C + 1 endpoints. The plugin sees the pool's
    registered buffers (:func:`~cpkv.disagg.buffers.registered_buffers`), not the pool. Timeout
    and debug switch come from ``settings.transfer`` and ``settings.debug``, the plugin's own
    settings from its table ``[transfer.<name>]`` (forwarded as given: the plugin validates it).

    Raises:
        SettingsError: the plugin's table fails its validation (naming the key and its source).
    """
    return transport.connect(LinkSpec(
        endpoint=endpoint, cp_size=cp_size, buffers=registered_buffers(pool.store),
        timeout_s=settings.transfer.timeout_s, debug=settings.debug, world_ranks=world_ranks,
        options=settings.transfer_table()))
