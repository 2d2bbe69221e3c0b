"""Routing drift: route volatility, rollout/trainer mismatch and expert load (`metrics`),
the alarms that act on them (`alarm`), route capture from HF models (`routes`), and the
`moe-rl drift` command (`offline`).

Names load with their module on first use (`moe_rl.lazy`): `moe_rl.config` reads this
package's `config.py` without importing the rest.
"""
from moe_rl.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "alarm": ("EXIT_DRIFT_ALARM", "HEALTH_ALARMS", "Alarms", "DriftAlarm"),
    "metrics": ("LOAD_PREFIX", "LOGPROB_PREFIX", "ROLLOUT_MISMATCH", "VOLATILITY", "DriftShapeError",
                "LogprobStats", "RouteStats", "all_reduce_counts", "expert_load", "load_change",
                "load_violation", "logprob_mismatch", "route_stats"),
})
