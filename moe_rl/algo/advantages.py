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


# Group estimators: a sample's advantage from its group's task rewards, on rank 0 before the step is
# handed out. Their keyword hyperparameters (grpo's `eps`) are the `algo.adv_<name>` config fields.
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


# --- value-based advantages (PPO / VC-PPO / VAPO) -------------------------------
#
# Per-token tensors `[B, T]` over one batch of sequences. Position t is one step of
# the token-level MDP: the state is the sequence so far, the action the next token.
# `mask` `[B, T]` marks the steps that count (a sequence's response tokens); they are
# consecutive steps of one episode, and everything outside the mask (prompt prefix,
# right padding, holes) is skipped. The value after a sequence's last step is 0.


def token_rewards(rewards: Tensor, mask: Tensor, per_token: Tensor | None = None) -> Tensor:
    """Per-token rewards `[B, T]`: the sequence reward `[B]` on each row's last masked step.

    `per_token` `[B, T]` (e.g. −β·KL to a reference policy) is added on every masked
    step. Rows without a masked step get nothing.
    """
    require(rewards.dim() == 1 and mask.dim() == 2 and mask.shape[0] == rewards.shape[0], "token_rewards",
            "shapes", (tuple(rewards.shape), tuple(mask.shape)), "[B] and [B, T]")
    m = mask.bool()
    t = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(m, t, -1).max(dim=1).values  # [B], -1 for an empty row
    out = torch.zeros(mask.shape, dtype=torch.promote_types(rewards.dtype, torch.float32), device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows].to(out.dtype)
    if per_token is not None:
        out = out + torch.where(m, per_token.to(out.dtype), 0.0)
    return out


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
                lam: float | Tensor = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation: (advantages, returns), both `[B, T]`, 0 outside `mask`.

    δ_t = r_t + γ·V_{t+1} − V_t, Â_t = Σ_i (γλ)^i δ_{t+i} over the row's masked steps,
    returns = Â + V. `rewards`, `values`, `mask`: `[B, T]` (see `token_rewards`);
    `lam`: one float, or `[B]` (one λ per sequence, e.g. `length_adaptive_lambda`).
    λ = 1 gives the reward-to-go minus V (Monte Carlo), λ = 0 one-step TD errors.
    """
    require(rewards.dim() == 2 and values.shape == rewards.shape and mask.shape == rewards.shape,
            "compute_gae", "shapes", (tuple(rewards.shape), tuple(values.shape), tuple(mask.shape)),
            "three equal [B, T]")
    require(0.0 <= gamma <= 1.0, "compute_gae", "gamma", gamma, "in [0, 1]")
    dtype = torch.promote_types(values.dtype, torch.float32)
    r, v, m = rewards.detach().to(dtype), values.detach().to(dtype), mask.bool()
    lam_t = torch.as_tensor(lam, dtype=dtype, device=v.device)
    require(lam_t.dim() == 0 or tuple(lam_t.shape) == (r.shape[0],), "compute_gae", "lam.shape",
            tuple(lam_t.shape), f"a float or [B] = ({r.shape[0]},)")
    require(bool(((lam_t >= 0) & (lam_t <= 1)).all()), "compute_gae", "lam", lam, "in [0, 1]")
    decay = gamma * lam_t
    adv = torch.zeros_like(v)
    next_value = torch.zeros(r.shape[0], dtype=dtype, device=v.device)
    running = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):  # skipped steps carry the next step's value and sum through
        step = m[:, t]
        cur = r[:, t] + gamma * next_value - v[:, t] + decay * running
        adv[:, t] = torch.where(step, cur, 0.0)
        running = torch.where(step, cur, running)
        next_value = torch.where(step, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns



# Critic estimators: per-token advantages from a learned value model's values, computed after the old
# pass on each rank's share (moe_rl/recipes/rl/critic.py); choosing one builds the critic.
CRITIC_ESTIMATORS: dict[str, Callable[..., Tensor]] = {"gae": compute_gae}
ESTIMATORS = (*ADVANTAGE_ESTIMATORS, *CRITIC_ESTIMATORS)  # every name `algo.advantage` takes


def length_adaptive_lambda(lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO's λ per sequence `[B]` from response lengths `[B]`: 1 − 1/(α·ℓ), clamped to [0, 1).

    Chosen so that Σ_t λ^t = 1/(1 − λ) = α·ℓ: long responses get a λ near 1 (little
    bias from the value model), short ones a smaller λ (less variance). α·ℓ <= 1 gives 0.
    """
    require(alpha > 0, "length_adaptive_lambda", "alpha", alpha, "> 0")
    scaled = alpha * lengths.to(torch.float64)
    lam = torch.where(scaled > 1, 1 - 1 / scaled.clamp(min=1e-12), torch.zeros_like(scaled))
    return lam.clamp(0.0, 1.0 - 1e-12).to(torch.promote_types(lengths.dtype, torch.float32))


def whiten(x: Tensor, mask: Tensor, sums: Callable[[Tensor], Tensor] | None = None,
           eps: float = 1e-8) -> Tensor:
    """(x − mean) / (std + eps) over the masked entries of `x` `[B, T]`; 0 outside the mask.

    `sums` reduces `[count, Σx, Σx²]` over the pieces of a batch (e.g. an all-reduce over
    data-parallel ranks), so every piece is whitened with the whole batch's statistics.
    """
    m = mask.bool()
    dt = torch.float64
    xs = torch.where(m, x.to(dt), 0.0)
    stats = torch.stack([m.sum().to(dt), xs.sum(), xs.square().sum()])
    stats = sums(stats) if sums is not None else stats
    n = stats[0].clamp(min=1)
    mean = stats[1] / n
    var = (stats[2] / n - mean.square()).clamp(min=0)
    out = (x.to(dt) - mean) / (var.sqrt() + eps)
    return torch.where(m, out, 0.0).to(x.dtype)
