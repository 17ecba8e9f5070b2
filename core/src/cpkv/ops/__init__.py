"""cpkv's compute ops: the per-run op table (the core's side) and the backend API.

* :mod:`cpkv.ops.api`: the one public module a backend imports from (the op protocol, argument
  checks, page-layout helpers, fp8 quantization; see its docstring). Its names (``api.__all__``)
  are re-exported here for the core.
* :mod:`cpkv.ops.table`: :class:`OpTable` (op -> the backend chosen for it, resolved once per run)
  and the op groups :data:`KV_OPS`, :data:`ATTN_OPS`, :data:`ALL_OPS`.
* :mod:`cpkv.ops.checks`, :mod:`cpkv.ops.layout`, :mod:`cpkv.ops.fp8`: where the API's
  functions live.
"""

from __future__ import annotations

from . import api
from .api import *  # noqa: F403  (the backend API's names, listed once in api.__all__)
from .table import ALL_OPS, ATTN_OPS, KV_OPS, OpTable

__all__ = [*api.__all__, "ALL_OPS", "ATTN_OPS", "KV_OPS", "OpTable"]
