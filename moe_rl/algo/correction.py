"""Rollout correction: what to do with tokens whose trainer and rollout probabilities disagree.

The rollout engine's probability of a sampled token, π_rollout, differs from the trainer's
π_old for the same weights (other kernels, other precision, and for an MoE other experts).
With r = π_old / π_rollout per token, every mode here multiplies each token's loss by a
detached factor, so it composes with every objective in `moe_rl.algo.losses`:

| mode         | factor                                                          | default bounds |
|--------------|-----------------------------------------------------------------|----------------|
| `tis`        | min(r, cap): truncated importance sampling (`moe_rl.algo.tis`)  | cap 2          |
| `token_mask` | 1 if low <= r <= high else 0 (masked importance sampling, MIS)  | [0.5, 2]       |
| `icepop`     | token_mask with IcePop's band (Ling team, Ring-1T, 2025)        | [0.5, 5]       |
| `seq_mask`   | 0 for every token of a sequence whose geometric-mean ratio      | [0.99, 1.01]   |
|              | exp(mean_t log r) lies outside [low, high]                      |                |

`tis` may be combined with a mask (`algo.tis_cap` with a mask mode): the weights multiply.
A masked token leaves the objective altogether (for GSPO and GMPO also its sequence's
mean log ratio, so it has no gradient at all), while the step's normalisers (its token
and sequence counts) stay those of the unmasked batch: a fully masked sequence adds
zero, and the loss stays exact under micro-batch and data-parallel splits. The seq_mask
band is ours: a 1% mean per-token disagreement, well above what matched kernels give
and well below a routing flip's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.algo._checks import require, require_choice
from moe_rl.algo.aggregation import masked_max, masked_mean, masked_min, masked_seq_mean
from moe_rl.algo.tis import tis_weights

CORRECTION_MODES = ("tis", "token_mask", "icepop", "seq_mask")
MASK_MODES = ("token_mask", "icepop", "seq_mask")
DEFAULT_BOUNDS = {"token_mask": (0.5, 2.0), "icepop": (0.5, 5.0), "seq_mask": (0.99, 1.01)}


@dataclass
class Correction:
    """What to train on and with which weights.

    weights: `[B, T]` detached factors of each token's loss (TIS; 1 without it).
    keep: `[B, T]` bool, false on the tokens a mask drops.
    token_stats: per-token values reported as means over the kept tokens (TIS).
    stats: 0-dim values over all valid tokens: `correction/masked_token_frac`,
    `correction/masked_seq_frac` (share of sequences with a dropped token), and the
    extremes `correction/ratio_min` / `correction/ratio_max` of r.
    """

    weights: Tensor
    keep: Tensor
    token_stats: dict[str, Tensor] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)


def rollout_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, mode: str | None = None,
                       bounds: tuple[float, float] | None = None, tis_cap: float | None = None,
                       tis_level: str = "token") -> Correction:
    """Loss factors for the trainer/rollout mismatch.

    old_logp, rollout_logp: `[B, T]` log π_old (trainer) and log π_rollout (engine) of the
    sampled tokens; mask: `[B, T]` valid response tokens. mode: None or one of
    `CORRECTION_MODES`; bounds: (low, high) on r for the mask modes (default
    `DEFAULT_BOUNDS`); tis_cap / tis_level: truncated IS, applied when a cap is given
    (mode "tis" without a cap uses 2). Masked positions get factor 1.
    """
    if mode is not None:
        require_choice(mode, CORRECTION_MODES, "rollout_correction", "mode")
    mask = mask.bool()
    log_r = torch.where(mask, old_logp.detach() - rollout_logp.detach(), 0.0)
    ratio = torch.exp(log_r)
    out = Correction(torch.ones_like(log_r), torch.ones_like(mask), stats={
        "correction/ratio_min": masked_min(ratio, mask), "correction/ratio_max": masked_max(ratio, mask)})
    if tis_cap is not None or mode == "tis":
        weights, capped = tis_weights(old_logp, rollout_logp, mask, level=tis_level, cap=tis_cap or 2.0)
        out.weights = weights
        out.token_stats |= {"loss/tis_clip_frac": capped, "loss/tis_weight_mean": weights}
    if mode in MASK_MODES:
        low, high = bounds if bounds is not None else DEFAULT_BOUNDS[mode]
        require(0 <= low < 1 < high, "rollout_correction", "bounds", (low, high), "low in [0, 1) and high > 1")
        if mode == "seq_mask":
            geo = torch.exp(masked_seq_mean(log_r, mask))  # [B, 1]
            drop = ((geo < low) | (geo > high)).expand_as(mask) & mask
        else:
            drop = ((ratio < low) | (ratio > high)) & mask
        seqs = mask.any(-1)
        out.keep = ~drop
        out.stats |= {"correction/masked_token_frac": masked_mean(drop.to(log_r.dtype), mask),
                      "correction/masked_seq_frac": (drop.any(-1) & seqs).sum() / seqs.sum().clamp(min=1)}
    return out
