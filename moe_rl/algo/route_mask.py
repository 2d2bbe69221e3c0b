"""Route-mismatch masking: the routing analogue of IcePop's ratio mask (moe_rl/algo/correction.py).

Under R2 or without replay the trainer routes each token itself, and where its routers choose
other experts than the rollout engine's did, the token's log-prob comes from another network
than the one that sampled it: its ratio pi_old / pi_rollout measures that only through the
log-prob, after the fact and mixed with kernel noise. The route mask looks at the cause: a token
whose top-k expert set differs from the engine's in more than `max_flips` MoE layers leaves the
objective. As with the ratio masks, masked tokens drop out of the loss (and of GSPO's sequence
mean log ratio) while the step's normalisers stay those of the unmasked batch (the caller passes
its global counts), so the loss stays exact under microbatch and data-parallel splits.

Under R3 the engine's routes are replayed, so the trainer's routes equal them by construction; the
optional native mask compares the trainer's free routing of the old pass with the replayed routes
instead, the same function on other inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algo._checks import require


def route_sets_differ(a: Tensor, b: Tensor) -> Tensor:
    """`[..., L]` bool: the top-k expert sets of `a` and `b` (`[..., L, K]`, ids distinct within a
    top-k, any integer dtype) differ in that layer; the order within a top-k does not count."""
    return (a.long().sort(-1).values != b.long().sort(-1).values).any(-1)


@dataclass
class RouteMask:
    """keep: `[B, T]` bool, false on the tokens the mask drops; flips: `[B, T, L]` bool, the compared
    response tokens' layers whose sets differ (false elsewhere)."""

    keep: Tensor
    flips: Tensor


def route_mask(engine: Tensor, trainer: Tensor, mask: Tensor, max_flips: int,
               comparable: Tensor | None = None) -> RouteMask:
    """Drop the tokens of `mask` (`[B, T]`, the response tokens) whose routes differ between `engine`
    and `trainer` (`[B, T, L, K]`) in more than `max_flips` layers. `comparable` (`[B, T, L]` bool):
    the layers where the engine has a route for the token (a layer without one neither flips nor
    counts); None = all."""
    require(max_flips >= 0, "route_mask", "max_flips", max_flips, ">= 0")
    require(engine.shape == trainer.shape and engine.dim() == 4, "route_mask", "routes' shapes",
            (tuple(engine.shape), tuple(trainer.shape)), "equal [B, T, L, K]")
    mask = mask.bool()
    flips = route_sets_differ(engine, trainer) & mask.unsqueeze(-1)
    if comparable is not None:
        flips &= comparable.bool()
    keep = ~(flips.sum(-1) > max_flips)
    return RouteMask(keep=keep, flips=flips)
