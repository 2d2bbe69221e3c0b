"""The trainer's maths as pure tensor code: advantages, filters, policy losses.

No model, no distributed state: every function maps tensors to tensors, so it
runs the same on a laptop CPU and inside a megatron-core trainer.
"""
from moe_rl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
)
from moe_rl.algo.aggregation import AGG_MODES, Normalizers, aggregate, count_normalizers
from moe_rl.algo.filters import DynamicSamplingResult, dynamic_sampling, overlong_penalty, shape_overlong_rewards
from moe_rl.algo.kl import KL_ESTIMATORS, kl_estimate
from moe_rl.algo.losses import LOSSES, Objective, compute_loss, get_loss, register_loss
from moe_rl.algo.tis import tis_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "DynamicSamplingResult", "KL_ESTIMATORS", "LOSSES", "Normalizers",
    "Objective", "aggregate", "broadcast_to_tokens", "compute_advantages", "compute_loss",
    "count_normalizers", "drgrpo_advantages", "dynamic_sampling", "get_loss", "grpo_advantages",
    "kl_estimate", "overlong_penalty", "register_loss", "rloo_advantages", "shape_overlong_rewards",
    "tis_weights",
]
