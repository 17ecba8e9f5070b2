"""Multi-rank runtime: the CP group wrapper and the bounded single-node launcher."""

from cpkv.runtime.group import CollectiveCheckError, CPGroup
from cpkv.runtime.launch import RankFailed, RankResult, RankTimeout, run_ranks

__all__ = [
    "CPGroup",
    "CollectiveCheckError",
    "RankFailed",
    "RankResult",
    "RankTimeout",
    "run_ranks",
]
