"""Group-relative advantages from scalar rewards.

Rewards `[B]` come in groups: the G samples drawn for one prompt. Say which
sample belongs to which group in one of two ways:

- ``group_size=G``: rewards are ordered as consecutive groups,
  ``[prompt0 sample0..G-1, prompt1 sample0..G-1, ...]``, and B is a multiple of G;
- ``group_index``: an integer tensor `[B]` of group ids (any values, any
  order; groups may differ in size, e.g. after filtering).

Estimators (per group g, R_i the reward of sample i):

- ``grpo``:   Â_i = (R_i − mean_g) / (std_g + eps)
- ``drgrpo``: Â_i = R_i − mean_g   (Dr.GRPO: dividing by std_g up-weights
  prompts that are nearly always solved or failed)
- ``rloo``:   Â_i = R_i − mean of the other G−1 rewards = G/(G−1)·(R_i − mean_g)

A group of size 1 has no baseline, so its advantage is 0; so is every
advantage of a group whose rewards are all equal.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from moe_rl.algo._checks import require, require_choice


def group_ids(batch_size: int, *, group_size: int | None = None,
              group_index: Tensor | None = None, device: torch.device | None = None) -> Tensor:
    """Dense group ids `[B]` in 0..K−1 from exactly one of `group_size` / `group_index`."""
    require((group_size is None) != (group_index is None), "group_ids", "group_size / group_index",
            (group_size, None if group_index is None else "tensor"), "exactly one given")
    if group_size is not None:
        require(group_size >= 1, "group_ids", "group_size", group_size, ">= 1")
        require(batch_size % group_size == 0, "group_ids", "group_size", group_size,
                f"a divisor of the batch size {batch_size}")
        return torch.arange(batch_size, device=device) // group_size
    require(tuple(group_index.shape) == (batch_size,), "group_ids", "group_index.shape",
            tuple(group_index.shape), f"({batch_size},)")
    require(not group_index.is_floating_point(), "group_ids", "group_index.dtype", group_index.dtype,
            "an integer type")
    return torch.unique(group_index, return_inverse=True)[1].to(device)


def group_stats(rewards: Tensor, ids: Tensor, *, unbiased: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, standard deviation and size of each sample's group, each `[B]`.

    `ids` are dense group ids `[B]` (see `group_ids`). The unbiased std (the
    default, as `torch.std`) of a group of size 1 is taken as 0.
    """
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    size = torch.bincount(ids, minlength=num_groups).to(rewards.dtype)
    mean = rewards.new_zeros(num_groups).index_add_(0, ids, rewards) / size.clamp(min=1)
    sq_dev = (rewards - mean[ids]).square()
    ssd = rewards.new_zeros(num_groups).index_add_(0, ids, sq_dev)
    dof = (size - 1).clamp(min=1) if unbiased else size.clamp(min=1)
    std = (ssd / dof).sqrt()
    return mean[ids], std[ids], size[ids]


def _prepare(rewards: Tensor, where: str, group_size: int | None,
             group_index: Tensor | None) -> tuple[Tensor, Tensor]:
    require(rewards.dim() == 1, where, "rewards.shape", tuple(rewards.shape), "[B]")
    rewards = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    ids = group_ids(rewards.shape[0], group_size=group_size, group_index=group_index,
                    device=rewards.device)
    return rewards, ids


def grpo_advantages(rewards: Tensor, *, group_size: int | None = None,
                    group_index: Tensor | None = None, eps: float = 1e-6,
                    unbiased: bool = True) -> Tensor:
    """GRPO: (R − group mean) / (group std + eps); `rewards` `[B]` -> `[B]`."""
    require(eps >= 0, "grpo_advantages", "eps", eps, ">= 0")
    rewards, ids = _prepare(rewards, "grpo_advantages", group_size, group_index)
    mean, std, _ = group_stats(rewards, ids, unbiased=unbiased)
    denom = std + eps
    # with eps = 0 an all-equal group would be 0/0; its advantage is 0 either way
    return (rewards - mean) / torch.where(denom > 0, denom, torch.ones_like(denom))


def drgrpo_advantages(rewards: Tensor, *, group_size: int | None = None,
                      group_index: Tensor | None = None) -> Tensor:
    """Dr.GRPO: R − group mean (no std scaling); `rewards` `[B]` -> `[B]`."""
    rewards, ids = _prepare(rewards, "drgrpo_advantages", group_size, group_index)
    mean, _, _ = group_stats(rewards, ids)
    return rewards - mean


def rloo_advantages(rewards: Tensor, *, group_size: int | None = None,
                    group_index: Tensor | None = None) -> Tensor:
    """RLOO: R − mean of the group's other samples; `rewards` `[B]` -> `[B]` (0 for singletons)."""
    rewards, ids = _prepare(rewards, "rloo_advantages", group_size, group_index)
    mean, _, size = group_stats(rewards, ids)
    # R_i − (sum − R_i)/(G − 1) = G/(G − 1)·(R_i − mean); a singleton has R_i = mean
    return (rewards - mean) * size / (size - 1).clamp(min=1)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence advantages `[B]` -> per-token `[B, T]`, zero where `mask` `[B, T]` is false."""
    require(advantages.dim() == 1 and mask.dim() == 2 and mask.shape[0] == advantages.shape[0],
            "broadcast_to_tokens", "shapes", (tuple(advantages.shape), tuple(mask.shape)), "[B] and [B, T]")
    return torch.where(mask.bool(), advantages[:, None], 0.0)


def compute_advantages(name: str, rewards: Tensor, *, group_size: int | None = None,
                       group_index: Tensor | None = None, mask: Tensor | None = None,
                       **params: float | bool) -> Tensor:
    """Advantages of estimator `name` (grpo, drgrpo, rloo) for `rewards` `[B]`.

    Returns `[B]`, or `[B, T]` broadcast over valid tokens when `mask` `[B, T]`
    is given. `params` go to the estimator (e.g. ``eps`` for grpo).
    """
    require_choice(name, ADVANTAGE_ESTIMATORS, "compute_advantages", "advantage estimator")
    accepted = [p.name for p in inspect.signature(ADVANTAGE_ESTIMATORS[name]).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in ("group_size", "group_index")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"compute_advantages: unknown parameter(s) {', '.join(map(repr, unknown))} for "
                         f"{name!r}; accepted: {', '.join(accepted) or 'none'}")
    adv = ADVANTAGE_ESTIMATORS[name](rewards, group_size=group_size, group_index=group_index, **params)
    return adv if mask is None else broadcast_to_tokens(adv, mask)
