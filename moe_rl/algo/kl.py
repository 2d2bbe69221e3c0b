"""Per-token KL estimators (Schulman's k1, k2, k3) from log-probability ratios."""
from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.algo._checks import require_choice

KL_ESTIMATORS = ("k1", "k2", "k3")

# exp(20) ~ 5e8: far past any useful ratio, far below overflow in float32
_MAX_LOG_RATIO = 20.0


def kl_estimate(log_ratio: Tensor, estimator: str = "k3") -> Tensor:
    """Estimate KL(p || q) per token from samples of p, given `log_ratio` = log p − log q `[B, T]`.

    - ``k1`` = log_ratio: unbiased, high variance, can be negative.
    - ``k2`` = log_ratio² / 2: biased, low variance, >= 0.
    - ``k3`` = exp(−log_ratio) − 1 + log_ratio: unbiased, low variance, >= 0
      (the one GRPO uses for its reference KL).

    k3 clamps `log_ratio` to ±20 first so a far-off token cannot overflow; its
    gradient is zero past the clamp. Returns `[B, T]` like the input.
    """
    require_choice(estimator, KL_ESTIMATORS, "kl_estimate", "KL estimator")
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    lr = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(-lr) - 1 + lr
