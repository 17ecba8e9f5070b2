"""``transfer.mooncake.protocol = "nvlink_intra"``: Mooncake's transport between GPUs of one
host (CUDA IPC over NVLink), set up the way the engine expects, or refused with the exact reason.

The engine chooses this transport from its environment, not from ``initialize``'s protocol
argument: ``MC_INTRANODE_NVLINK`` present (any value) when ``mooncake.engine`` is imported, then
``initialize(host, "P2PHANDSHAKE", "tcp", "")``; ``MC_FORCE_TCP`` wins over it (then the link is
plain TCP, with the host staging of GPU memory). ``protocol = "nvlink"`` is multi-node NVLink
(``USE_MNNVL``), another thing. The transport exports a ``cudaIpcGetMemHandle`` of the whole
allocation holding each registered buffer, so the pool must be plain ``cudaMalloc`` memory on a
CUDA device: not expandable segments (``cuMem*``/VMM) nor the ``cudaMallocAsync`` allocator.
Only the CUDA wheels (``mooncake-transfer-engine``, ``-cuda13``) have the transport.

Light: no torch, no engine. The checks read only facts that every endpoint of one host shares
(wheel, environment) and its buffers' device type, before any collective: every endpoint of a
same-host job refuses alike.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CUDA_WHEELS", "ENV_FORCE_TCP", "ENV_INTRANODE", "NVLINK_INTRA", "ProtocolRefused",
           "ProtocolSetup", "allocator_problem", "installed_wheels", "plan_protocol",
           "prepare_environment"]

NVLINK_INTRA = "nvlink_intra"
#: present when ``mooncake.engine`` is imported: the engine's intra-node NVLink transport
ENV_INTRANODE = "MC_INTRANODE_NVLINK"
#: present: the engine uses TCP whatever else is set (a user's override)
ENV_FORCE_TCP = "MC_FORCE_TCP"
#: multi-node NVLink: never combined with the intra-node transport
ENV_FORCE_MNNVL = "MC_FORCE_MNNVL"
#: the wheels built with CUDA (and the intra-node NVLink transport); all install ``mooncake``
CUDA_WHEELS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")
ALL_WHEELS = ("mooncake-transfer-engine-non-cuda", *CUDA_WHEELS)
#: torch's allocator settings, the new name first (PYTORCH_CUDA_ALLOC_CONF is its older alias)
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


class ProtocolRefused(RuntimeError):
    """The configured ``transfer.mooncake.protocol`` cannot run here; the message names every
    reason (raised at connect, before any collective)."""


@dataclass(frozen=True)
class ProtocolSetup:
    """How a link runs ``transfer.mooncake.protocol``.

    Attributes:
        configured: the setting.
        engine: the protocol argument of ``initialize`` (``"tcp"`` for ``nvlink_intra``).
        effective: what moves the bytes: ``nvlink_intra``, or ``tcp`` under ``MC_FORCE_TCP``,
            else the setting (decides the host staging of GPU memory).
        forced_tcp: ``MC_FORCE_TCP`` overrode ``nvlink_intra``.
    """

    configured: str
    engine: str
    effective: str
    forced_tcp: bool = False

    @property
    def intra_nvlink(self) -> bool:
        return self.effective == NVLINK_INTRA


def installed_wheels() -> list[str]:
    """The Mooncake wheels installed (distribution names)."""
    names = []
    for dist in ALL_WHEELS:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        names.append(dist)
    return names


def allocator_problem(environ: Mapping[str, str]) -> str | None:
    """Why torch's CUDA allocator, as configured in ``environ``, makes memory that
    ``cudaIpcGetMemHandle`` cannot export (None: plain ``cudaMalloc`` segments)."""
    for var in ALLOC_CONF_VARS:
        conf = environ.get(var, "")
        for item in conf.split(","):
            key, _, value = (s.strip() for s in item.partition(":"))
            if key == "expandable_segments" and value.lower() in ("true", "1"):
                return (f"{var}={conf!r} enables expandable_segments: the pool is cuMem*/VMM "
                        f"memory, which the engine cannot export with cudaIpcGetMemHandle "
                        f"(unset it: the pool must be plain cudaMalloc memory)")
            if key == "backend" and value == "cudaMallocAsync":
                return (f"{var}={conf!r} selects the cudaMallocAsync allocator: its pool memory "
                        f"cannot be exported with cudaIpcGetMemHandle (use the native allocator)")
    return None


def plan_protocol(protocol: str, device_type: str, *, environ: Mapping[str, str] | None = None,
                  wheels: Sequence[str] | None = None,
                  engine_imported: bool | None = None) -> ProtocolSetup:
    """How to run ``protocol`` for buffers on ``device_type``; for ``nvlink_intra`` every check
    runs first (the defaults read this process: ``os.environ``, the installed wheels, whether
    ``mooncake.engine`` is imported).

    Raises:
        ProtocolRefused: ``nvlink_intra`` cannot run here; the message names every reason (a
            non-CUDA wheel, buffers off CUDA, an allocator whose memory cannot be exported, the
            engine imported before ``MC_INTRANODE_NVLINK`` was set, ``MC_FORCE_MNNVL`` set).
    """
    if protocol != NVLINK_INTRA:
        return ProtocolSetup(protocol, protocol, protocol)
    env = os.environ if environ is None else environ
    if ENV_FORCE_TCP in env:
        return ProtocolSetup(protocol, "tcp", "tcp", forced_tcp=True)
    wheels = installed_wheels() if wheels is None else list(wheels)
    imported = "mooncake.engine" in sys.modules if engine_imported is None else engine_imported
    reasons = []
    if not any(w in CUDA_WHEELS for w in wheels):
        have = ", ".join(wheels) or "none"
        reasons.append(f"the installed Mooncake wheel ({have}) has no intra-node NVLink transport: "
                       f"install {' or '.join(CUDA_WHEELS)} (a CUDA build)")
    if device_type != "cuda":
        reasons.append(f"the pool's buffers are on {device_type}, not a CUDA device: the "
                       f"transport maps GPU memory")
    alloc = allocator_problem(env)
    if alloc is not None:
        reasons.append(alloc)
    if imported and ENV_INTRANODE not in env:
        reasons.append(f"mooncake.engine was imported in this process before {ENV_INTRANODE} "
                       f"was set (the engine reads it at import): select the protocol before "
                       f"the engine is loaded, or set {ENV_INTRANODE}=1 in the environment")
    if ENV_FORCE_MNNVL in env:
        reasons.append(f"{ENV_FORCE_MNNVL} is set: multi-node NVLink and the intra-node "
                       f"transport do not combine")
    if reasons:
        raise ProtocolRefused(f"transfer.mooncake.protocol = {NVLINK_INTRA!r} refused: "
                              + "; ".join(reasons) + " (no silent TCP: set MC_FORCE_TCP=1 or "
                              "protocol = 'tcp' to move the pages over TCP)")
    return ProtocolSetup(protocol, "tcp", NVLINK_INTRA)


def prepare_environment(setup: ProtocolSetup) -> None:
    """Set what the engine reads at import for ``setup`` (``MC_INTRANODE_NVLINK=1`` for the
    intra-node transport); call before ``mooncake.engine`` is imported."""
    if setup.intra_nvlink:
        os.environ.setdefault(ENV_INTRANODE, "1")
