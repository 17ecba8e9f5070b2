"""Declares the ``mooncake`` transfer (entry point ``cpkv.transfers: mooncake``).

Importing this module imports neither torch nor mooncake. The probe looks the ``mooncake``
package up and loads the system libraries its engine links (``libibverbs.so.1``, ...) without
importing it: discovery stays light, and a missing library is a precise reason instead of a crash.
``load()`` checks the probe's reasons and returns the transport, which imports the engine
(``import_engine``: ``MC_LOG_LEVEL=ERROR`` unless set, glog floods stderr otherwise) at its first
connect, after the protocol's environment is set (``transport.py``, the heavy implementation,
gets ``import_engine`` itself). Imports run one way: ``transport.py`` never imports this module.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from cpkv.contracts import Availability
from cpkv.plugin import TransferRegistrar, TransferSpec, hookimpl

from .nvlink import CUDA_WHEELS, installed_wheels

NAME = "mooncake"
NOT_INSTALLED = ("mooncake-transfer-engine not installed (pip install "
                 "mooncake-transfer-engine-non-cuda on CPU machines, mooncake-transfer-engine "
                 "(CUDA 12) or mooncake-transfer-engine-cuda13 on GPU machines)")
#: system libraries the engine links that are not in the wheel, and the Debian package of each
SYSTEM_LIBS = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1",
               "libcurl.so.4": "libcurl4"}


def _can_load(lib: str) -> bool:
    try:
        ctypes.CDLL(lib)
    except OSError:
        return False
    return True


def _reasons() -> list[str]:
    reasons: list[str] = []
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):  # a broken parent package or spec counts as missing
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return [NOT_INSTALLED]
    pkg = Path(next(iter(spec.submodule_search_locations)))
    if not any(pkg.glob("engine*.so")):
        reasons.append(f"the mooncake package at {pkg} has no transfer engine (engine*.so); "
                       "reinstall mooncake-transfer-engine-non-cuda")
    missing = [f"{lib} (apt-get install {deb})" for lib, deb in SYSTEM_LIBS.items()
               if not _can_load(lib)]
    if missing:
        reasons.append(f"the Mooncake engine needs system libraries that are missing: "
                       f"{', '.join(missing)}")
    wheels = installed_wheels()
    if len(wheels) > 1:
        reasons.append(f"several Mooncake wheels are installed ({', '.join(wheels)}); they share "
                       "the 'mooncake' package: keep exactly one")
    if any(w in CUDA_WHEELS for w in wheels) and not _can_load("libcuda.so.1"):
        reasons.append(f"{wheels[0]} is a CUDA build and libcuda.so.1 (the NVIDIA driver) is "
                       "missing: use mooncake-transfer-engine-non-cuda on CPU machines")
    return reasons


def probe() -> Availability:
    """Every check runs; an unavailable result names all the failing ones, joined by "; "."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def import_engine() -> type:
    """``mooncake.engine.TransferEngine``, imported with ``MC_LOG_LEVEL=ERROR`` unless set.

    Raises:
        RuntimeError: the probe's reasons, or the import's own error.
    """
    reasons = _reasons()
    if reasons:
        raise RuntimeError(f"the mooncake transfer cannot be loaded: {'; '.join(reasons)}")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(f"the mooncake transfer cannot be loaded: importing mooncake.engine "
                           f"failed ({exc})") from exc
    return TransferEngine


def load() -> object:
    """The transport (``cpkv.disagg.transport.Transport``); it imports the engine
    (:func:`import_engine`) at its first ``connect``, once the protocol's environment is set
    (``nvlink_intra`` needs ``MC_INTRANODE_NVLINK`` before the import).

    Raises:
        RuntimeError: the probe's reasons (the engine cannot be imported here).
    """
    reasons = _reasons()
    if reasons:
        raise RuntimeError(f"the mooncake transfer cannot be loaded: {'; '.join(reasons)}")
    from .transport import MooncakeTransport

    return MooncakeTransport(import_engine)


@hookimpl
def cpkv_register_transfers(registrar: TransferRegistrar) -> None:
    registrar.add(TransferSpec(name=NAME, probe=probe, load=load,
                               description="Mooncake Transfer Engine (P2P handshake; TCP, RDMA, "
                                           "NVLink)"))
