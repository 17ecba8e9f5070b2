"""cpkv: page-aligned shared KV for context-parallel prefill of sparse-attention models.

The public API for engines that embed cpkv (see docs/api.md)::

    import cpkv

    settings = cpkv.load_settings("cpkv.toml")            # TOML + CPKV_* environment
    plan = cpkv.plan_batch([(0, 1010), (0, 7)], cp_size=2) # a split plan (pure host code)
    group = cpkv.CPGroup.from_process_group()              # this rank's CP group
    model = cpkv.load_model("/path/to/checkpoint")         # or "tiny"
    session = cpkv.PrefillSession(model, settings, group)  # ops, startup checks, sharded pool
    result = session.prefill([("req-0", token_ids)])       # logits; KV stays in the pool
    session.pages("req-0")                                  # owners and slots of its pages

Names are imported on first use, so ``import cpkv`` stays light (no torch until needed).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from cpkv._lifetime import die_with_parent_from_env

# a rank process run_ranks is starting dies with its parent from here on (before torch loads)
die_with_parent_from_env()

try:
    __version__ = version("cpkv-core")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

#: public name -> module that defines it
_API = {
    "load_settings": "cpkv.settings",
    "Settings": "cpkv.settings",
    "SettingsError": "cpkv.settings",
    "plan_batch": "cpkv.planning",
    "PlanError": "cpkv.planning",
    "CPPlan": "cpkv.contracts",
    "RequestSpec": "cpkv.contracts",
    "KVFormat": "cpkv.contracts",
    "SplitMode": "cpkv.contracts",
    "FallbackError": "cpkv.fallback",
    "recording": "cpkv.fallback",
    "ShardedKVPool": "cpkv.kv",
    "PoolExhausted": "cpkv.kv",
    "create_pool": "cpkv.runtime.setup",
    "StartupError": "cpkv.runtime.setup",
    "CPGroup": "cpkv.comm",
    "run_ranks": "cpkv.runtime.launch",
    "RankFailed": "cpkv.runtime.launch",
    "PrefillSession": "cpkv.runtime.session",
    "PrefillResult": "cpkv.runtime.prefill",
    "load_model": "cpkv.models",
    "DeepseekV32": "cpkv.models",
}

__all__ = ["__version__", *sorted(_API)]


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cpkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs
    from cpkv.comm import CPGroup
    from cpkv.contracts import CPPlan, KVFormat, RequestSpec, SplitMode
    from cpkv.fallback import FallbackError, recording
    from cpkv.kv import PoolExhausted, ShardedKVPool
    from cpkv.models import DeepseekV32, load_model
    from cpkv.planning import PlanError, plan_batch
    from cpkv.runtime.launch import RankFailed, run_ranks
    from cpkv.runtime.prefill import PrefillResult
    from cpkv.runtime.session import PrefillSession
    from cpkv.runtime.setup import StartupError, create_pool
    from cpkv.settings import Settings, SettingsError, load_settings
