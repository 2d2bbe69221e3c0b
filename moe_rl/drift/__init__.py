"""Routing drift: route volatility, rollout/trainer mismatch and expert load (`metrics`),
route capture from HF models (`routes`), and the `moe-rl drift` command (`offline`)."""
from moe_rl.drift.metrics import (LOAD_PREFIX, LOGPROB_PREFIX, ROLLOUT_MISMATCH, VOLATILITY, DriftShapeError,
                                  LogprobStats, RouteStats, all_reduce_counts, expert_load, load_change,
                                  logprob_mismatch, route_dtype, route_stats)

__all__ = ["LOAD_PREFIX", "LOGPROB_PREFIX", "ROLLOUT_MISMATCH", "VOLATILITY", "DriftShapeError", "LogprobStats",
           "RouteStats", "all_reduce_counts", "expert_load", "load_change", "logprob_mismatch", "route_dtype",
           "route_stats"]
