"""Declares the ``cuda`` backend (entry point ``cpkv.backends: cuda``): the field's CUDA kernels.

Two kernel libraries, each optional, each imported lazily:

- FlashMLA (``sgl-flash-mla``, the ``cpkv[cuda]`` extra; :mod:`cpkv_backend_cuda.flashmla`):
  sparse MLA prefill, the fp8 sparse decode over part-major pages, and DeepSeek-V4's sparse
  attention with the sink (``v4_attention``).
- DeepGEMM (``deep_gemm``, built from source against the machine's torch: docs/plugins.md;
  :mod:`cpkv_backend_cuda.deepgemm`): the fp8 lightning indexer, prefill and paged.

The backend provides the ops of the libraries that are installed (found without importing
them), less those a measurement put on another backend (:data:`MEASURED`); a library that is
not installed is passed over quietly (its ops go to the next backend of the preference).
Importing this module imports no torch and no kernel library; the probe imports the installed
ones (once) and says exactly why the backend cannot run: no CUDA device, a compute capability
other than SM90 (the legacy sparse kernels and DeepGEMM's SM90 indexer are Hopper's), neither
library installed, or the import error of one that is. A call a kernel cannot take (heads, head
dims, dtype, top-k) is declined and runs on the next backend of the preference.

On a machine whose torch is older than the wheel's metadata asks (e.g. torch 2.11 where
the wheel says >= 2.14.1) install FlashMLA with ``pip install --no-deps sgl-flash-mla``: it
loads through torch's stable ABI.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, cast

from cpkv.contracts import Availability, KVOps, Op
from cpkv.ops.api import OpMethods
from cpkv.plugin import BackendRegistrar, BackendSpec, cuda_device_missing, hookimpl

if TYPE_CHECKING:
    from .deepgemm import DeepGEMMOps

NAME = "cuda"
#: compute capabilities whose kernels the libraries ship for (FlashMLA's legacy SM90 sparse
#: path, DeepGEMM's SM90 indexer)
CAPABILITIES = ((9, 0),)


@dataclass(frozen=True)
class Library:
    """A kernel library the backend uses: its module, the ops it serves, how to install it."""

    module: str
    ops: frozenset[Op]
    install: str
    #: an attribute the module must have (a build without the kernels lacks it)
    needs: str


FLASH_MLA = Library("flash_mla", frozenset({Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED, Op.V4_ATTENTION}),
                    "install sgl-flash-mla (pip install 'cpkv[cuda]', or --no-deps for an older "
                    "torch)", "flash_mla_sparse_fwd")
DEEP_GEMM = Library("deep_gemm", frozenset({Op.INDEXER_LOGITS, Op.INDEXER_LOGITS_INDEX_PAGES}),
                    "build DeepGEMM against this torch (docs/plugins.md)", "fp8_fp4_mqa_logits")
LIBRARIES = (FLASH_MLA, DEEP_GEMM)

#: ops a library provides that a measurement on the GPU put on another backend (the op table
#: takes the first backend of the preference that lists an op): op -> the measurement
#: (docs/perf.md "Targets" and "Tuning sweeps"). DeepGEMM's paged indexer cannot read
#: the part-major pool's index-K (:mod:`cpkv_backend_cuda.deepgemm`): it offers the two_part
#: layout's op only.
MEASURED: dict[Op, str] = {
    Op.INDEXER_LOGITS: "2026-12-03: DeepGEMM's fp8_fp4_mqa_logits 1.4-7.3 % slower than "
                       "the Triton fp8 indexer at 1Kx32K / 4Kx128K / 8Kx64K / 2Kx512K (the kernel "
                       "alone 0.4-6.6 %)",
    Op.INDEXER_LOGITS_INDEX_PAGES: "2026-12-04: DeepGEMM's fp8_fp4_paged_mqa_logits 0.330 ms "
                                   "against the Triton page-tile kernel's 0.286 on the same "
                                   "page-major tensors, 64 requests x 128K keys "
                                   "(docs/perf.md, Tuning sweeps)",
}


def installed(lib: Library) -> bool:
    """Whether the library's module can be found (without importing it)."""
    try:
        return importlib.util.find_spec(lib.module) is not None
    except (ImportError, ValueError):
        return False


def provided_ops(found: Callable[[Library], bool] = installed) -> frozenset[Op]:
    """The ops this backend lists: those of the installed libraries, less :data:`MEASURED`."""
    ops = frozenset().union(*(lib.ops for lib in LIBRARIES if found(lib)))
    return frozenset(o for o in ops if o not in MEASURED)


def _cuda_device_missing() -> str | None:
    why = cuda_device_missing()
    if why is not None:
        return why
    import torch

    cap = torch.cuda.get_device_capability()
    if cap not in CAPABILITIES:
        return (f"compute capability {cap[0]}.{cap[1]}: the kernels here (FlashMLA's sparse "
                f"MLA, DeepGEMM's indexer) are for "
                f"{', '.join(f'{a}.{b}' for a, b in CAPABILITIES)} (Hopper)")
    return None


@functools.cache
def _module(lib: Library) -> ModuleType | str:
    """The imported module of ``lib``, or why it cannot be used."""
    try:
        mod = importlib.import_module(lib.module)
    except Exception as exc:
        return f"{lib.module} cannot be imported ({type(exc).__name__}: {exc}); {lib.install}"
    if not hasattr(mod, lib.needs):
        return f"{lib.module} has no {lib.needs} (a build without the kernels cpkv calls)"
    return mod


def _reasons() -> list[str]:
    why = _cuda_device_missing()
    if why is not None:
        return [why]
    libs = [lib for lib in LIBRARIES if installed(lib)]
    if not libs:
        return ["neither flash_mla nor deep_gemm is installed; "
                + "; ".join(lib.install for lib in LIBRARIES)]
    return [m for m in (_module(lib) for lib in libs) if isinstance(m, str)]


def probe() -> Availability:
    """Available on a Hopper GPU where every installed kernel library imports; otherwise the
    reason."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> KVOps:
    """Raises:
        RuntimeError: the backend cannot run here (the probe's reason).
    """
    reasons = _reasons()
    if reasons:
        raise RuntimeError(f"the cuda backend cannot be loaded: {'; '.join(reasons)}")
    ops = provided_ops()
    methods: dict[Op, Callable[..., object]] = {}
    if installed(FLASH_MLA):
        from .flashmla import FlashMLAOps

        fm = _module(FLASH_MLA)
        assert isinstance(fm, ModuleType)
        kernels = FlashMLAOps(fm)
        methods.update({Op.SPARSE_MLA: kernels.sparse_mla,
                        Op.SPARSE_MLA_PAGED: kernels.sparse_mla_paged,
                        Op.V4_ATTENTION: kernels.v4_attention})
    if installed(DEEP_GEMM):
        from .deepgemm import DeepGEMMOps

        dg = _module(DEEP_GEMM)
        assert isinstance(dg, ModuleType)
        dgo = DeepGEMMOps(dg)
        methods[Op.INDEXER_LOGITS] = dgo.indexer_logits
        methods[Op.INDEXER_LOGITS_INDEX_PAGES] = dgo.indexer_logits_index_pages
    return cast(KVOps, OpMethods({o: f for o, f in methods.items() if o in ops}))


def deepgemm_ops() -> DeepGEMMOps:
    """The DeepGEMM kernels object (:class:`cpkv_backend_cuda.deepgemm.DeepGEMMOps`): its ops
    whatever a measurement chose (:data:`MEASURED`), for tests and measurements.

    Raises:
        RuntimeError: the backend cannot run here, or DeepGEMM is not installed.
    """
    reasons = _reasons() or ([] if installed(DEEP_GEMM) else
                             [f"deep_gemm is not installed; {DEEP_GEMM.install}"])
    if reasons:
        raise RuntimeError(f"DeepGEMM cannot be used: {'; '.join(reasons)}")
    from .deepgemm import DeepGEMMOps as Ops

    dg = _module(DEEP_GEMM)
    assert isinstance(dg, ModuleType)
    return Ops(dg)


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=provided_ops(), probe=probe, load=load,
                              device_types=lambda: frozenset({"cuda"}),
                              description="the field's CUDA kernels (FlashMLA sparse MLA, "
                                          "DeepGEMM's fp8 indexer), imported lazily"))
