"""DAPO's batch filters: dynamic sampling and overlong reward shaping.

Dynamic sampling drops groups whose rewards are all equal (for 0/1 rewards:
all correct or all wrong, i.e. keep 0 < #correct < G). Their group-relative
advantages are all zero, so they cost a forward and backward and teach
nothing, while still diluting the normalisers of the rest of the batch.

Overlong shaping adds a length penalty that grows linearly over the last
`cache_len` tokens before `max_len`, so truncated answers are discouraged
smoothly rather than by a cliff.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algo._checks import require
from moe_rl.algo.advantages import group_ids


@dataclass(frozen=True)
class DynamicSamplingResult:
    """Which samples survive dynamic sampling, and a report.

    `keep` holds the indices `[K]` (int64, ascending, so group order is kept)
    of samples in kept groups; it is empty when `all_dropped` is true, in
    which case the caller decides: sample more prompts, or skip the step.
    """

    keep: Tensor
    num_groups: int
    num_kept_groups: int
    num_dropped_groups: int
    all_dropped: bool
    message: str

    def metrics(self) -> dict[str, float]:
        """Namespaced floats for the metrics sink."""
        return {
            "filter/num_groups": float(self.num_groups),
            "filter/kept_groups": float(self.num_kept_groups),
            "filter/dropped_groups": float(self.num_dropped_groups),
            "filter/kept_samples": float(self.keep.numel()),
        }


def dynamic_sampling(rewards: Tensor, *, group_size: int | None = None,
                     group_index: Tensor | None = None, tol: float = 0.0) -> DynamicSamplingResult:
    """Keep the groups whose rewards are not all equal (max − min > `tol`).

    `rewards` `[B]`, grouped by `group_size` (consecutive groups) or
    `group_index` `[B]`, as in `moe_rl.algo.advantages`. A group of size 1 is
    always dropped: its rewards are trivially all equal.
    """
    require(rewards.dim() == 1, "dynamic_sampling", "rewards.shape", tuple(rewards.shape), "[B]")
    require(tol >= 0, "dynamic_sampling", "tol", tol, ">= 0")
    ids = group_ids(rewards.shape[0], group_size=group_size, group_index=group_index,
                    device=rewards.device)
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    high = r.new_full((num_groups,), float("-inf")).scatter_reduce(0, ids, r, "amax")
    low = r.new_full((num_groups,), float("inf")).scatter_reduce(0, ids, r, "amin")
    kept_group = (high - low) > tol
    keep = torch.nonzero(kept_group[ids]).flatten()
    kept = int(kept_group.sum())
    dropped = num_groups - kept
    return DynamicSamplingResult(keep, num_groups, kept, dropped, kept == 0,
                                 _report(num_groups, kept, dropped, keep.numel()))


def _report(num_groups: int, kept: int, dropped: int, kept_samples: int) -> str:
    if num_groups == 0:
        return "dynamic sampling: empty batch, nothing to keep"
    if kept == 0:
        return (f"dynamic sampling: all {num_groups} groups dropped (every group's rewards are equal); "
                "no samples left to train on: sample more prompts or skip this step")
    return (f"dynamic sampling: kept {kept} of {num_groups} groups ({kept_samples} samples), "
            f"dropped {dropped} whose rewards are all equal")


def overlong_penalty(lengths: Tensor, *, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong penalty per response, `lengths` `[B]` -> `[B]` in [−1, 0].

    0 up to `max_len − cache_len` tokens, then linear down to −1 at `max_len`,
    and −1 beyond. `cache_len = 0` gives a hard step past `max_len`.
    """
    require(max_len > 0, "overlong_penalty", "max_len", max_len, "> 0")
    require(0 <= cache_len <= max_len, "overlong_penalty", "cache_len", cache_len,
            f"in [0, max_len={max_len}]")
    lengths = lengths.to(torch.float64)
    if cache_len == 0:
        penalty = torch.where(lengths > max_len, -1.0, 0.0)
    else:
        penalty = ((max_len - cache_len - lengths) / cache_len).clamp(-1.0, 0.0)
    return penalty.to(torch.get_default_dtype())


def shape_overlong_rewards(rewards: Tensor, lengths: Tensor, *, max_len: int, cache_len: int,
                           factor: float = 1.0) -> Tensor:
    """`rewards` `[B]` plus `factor` × `overlong_penalty(lengths)` `[B]`."""
    require(factor >= 0, "shape_overlong_rewards", "factor", factor, ">= 0")
    require(rewards.shape == lengths.shape, "shape_overlong_rewards", "lengths.shape",
            tuple(lengths.shape), f"rewards' {tuple(rewards.shape)}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # 0/1 ints welcome
    penalty = overlong_penalty(lengths, max_len=max_len, cache_len=cache_len)
    return rewards + factor * penalty.to(rewards.dtype)
