"""The trainer's maths as pure tensor code: advantages, filters, policy losses.

No model, no distributed state: every function maps tensors to tensors, so it
runs the same on a laptop CPU and inside a megatron-core trainer.

Names load with their module on first use (`moe_rl.lazy`): `moe_rl.config` reads this
package's `config.py` without importing the rest.
"""
from moe_rl.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "advantages": ("ADVANTAGE_ESTIMATORS", "broadcast_to_tokens", "compute_advantages", "drgrpo_advantages",
                   "grpo_advantages", "rloo_advantages"),
    "aggregation": ("AGG_MODES", "Normalizers", "aggregate", "count_normalizers"),
    "filters": ("DynamicSamplingResult", "dynamic_sampling", "overlong_penalty", "shape_overlong_rewards"),
    "kl": ("KL_ESTIMATORS", "kl_estimate"),
    "losses": ("LOSSES", "Objective", "compute_loss", "get_loss", "register_loss"),
    "tis": ("tis_weights",),
})
