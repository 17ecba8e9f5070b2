"""cpkv's compute ops: the per-run op table (the core's side) and the backend API.

* :mod:`cpkv.ops.api`: the one public module a backend imports from (the op protocol, argument
  checks, page-layout helpers, fp8 quantization; see its docstring). Its names (``api.__all__``)
  are re-exported here for the core.
* :mod:`cpkv.ops.table`: :class:`OpTable` (op -> the backend chosen for it, resolved once per run)
  and the op groups :data:`KV_OPS`, :data:`ATTN_OPS`, :data:`DSA_OPS` (the two: a
  DeepSeek-V3.2 / GLM-5 run's), :data:`V4_OPS` (DeepSeek-V4's), :data:`ALL_OPS`.
* :func:`v4_op_table` (:mod:`cpkv.ops.v4`): DeepSeek-V4's ops resolved through the registry.
* :mod:`cpkv.ops.checks`, :mod:`cpkv.ops.layout`, :mod:`cpkv.ops.fp8`: where the API's
  functions live.
"""

from __future__ import annotations

from . import api
from .api import *  # noqa: F403  (the backend API's names, listed once in api.__all__)
from .table import ALL_OPS, ATTN_OPS, DSA_OPS, KV_OPS, V4_OPS, OpTable
from .v4 import v4_op_table

__all__ = [*api.__all__, "ALL_OPS", "ATTN_OPS", "DSA_OPS", "KV_OPS", "V4_OPS", "OpTable",
           "v4_op_table"]
