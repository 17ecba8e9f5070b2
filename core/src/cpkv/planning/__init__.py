"""Pure CP split planners: zigzag and interleave, page-aligned, with the token-balanced fallback."""

from .planner import PlanError, plan_batch, plan_request

__all__ = ["PlanError", "plan_batch", "plan_request"]
