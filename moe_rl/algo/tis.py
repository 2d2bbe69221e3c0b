"""Truncated importance sampling (TIS) for the rollout-engine / trainer mismatch.

The rollout engine samples with its own kernels (and, for MoE, possibly other
experts), so its probabilities π_rollout differ from the trainer's π_old for
the same tokens. Reweighting each token's loss by π_old / π_rollout corrects
the off-policy bias; capping the weight at `cap` bounds its variance.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_rl.algo._checks import require, require_choice

TIS_LEVELS = ("token", "sequence")


def tis_weights(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
) -> tuple[Tensor, Tensor]:
    """Detached weights min(π_old / π_rollout, cap) and where the cap bit, both `[B, T]`.

    `old_logp`, `rollout_logp`, `mask`: `[B, T]`. ``level="token"`` weighs each
    token by its own ratio; ``level="sequence"`` weighs every token of sequence
    i by the ratio of the whole sequence, exp(sum_t log ratio), which is
    unbiased for sequence-level objectives but has higher variance. Masked
    positions get weight 1 and are never counted as capped.
    """
    require_choice(level, TIS_LEVELS, "tis_weights", "TIS level")
    require(cap > 0, "tis_weights", "cap", cap, "> 0")
    mask = mask.bool()
    log_w = torch.where(mask, old_logp.detach() - rollout_logp.detach(), 0.0)
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    # cap in log space: a long sequence's summed log ratio can overflow exp
    capped = (log_w > math.log(cap)) & mask
    weights = torch.exp(log_w.clamp(max=math.log(cap)))
    return weights, capped
