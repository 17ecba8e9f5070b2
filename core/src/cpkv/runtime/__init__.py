"""Multi-rank runtime: the prefill driver, sessions, the decode worker and the bounded
single-node launcher. (The CP group itself is :mod:`cpkv.comm`.)"""

from cpkv.runtime.launch import RankFailed, RankResult, RankTimeout, run_ranks

__all__ = [
    "RankFailed",
    "RankResult",
    "RankTimeout",
    "run_ranks",
]
