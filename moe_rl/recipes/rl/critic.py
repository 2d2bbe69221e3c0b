"""The critic's stage of an RL step (`algo.advantage=gae`: PPO, VC-PPO, VAPO).

    values V(s_t) of the step's samples (one critic forward, its routes recorded)
      -> token rewards (the sequence reward on the last response token)
      -> GAE twice with decoupled λ: the policy's advantages (algo.lam, or VAPO's
         length-adaptive λ) and the critic's targets (critic.lam, VC-PPO's 1.0)
      -> critic.updates_per_step passes of clipped value-loss updates over the
         step's minibatches (R2 replays the critic's own routes)
      -> the critic's expert volatility across its updates

During value pretraining (`critic.warmup_steps`) only the critic trains; the policy,
and so the rollouts, stay the initial ones. Runs on every trainer rank, like loop.py.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from moe_rl.algo.advantages import compute_gae, length_adaptive_lambda, token_rewards, whiten
from moe_rl.algo.losses import value_loss
from moe_rl.drift.metrics import route_stats
from moe_rl.recipes.common import combine_loss_metrics, mean_metrics
from moe_rl.samples import response_mask

log = logging.getLogger(__name__)


def critic_step(run: Any, share: Any, old: Any, step: int) -> dict[str, float]:
    """Values, GAE advantages (written to `share.samples.advantages`, `[B, T - 1]`), critic updates.

    `old`: the policy's old pass (`old_pass.OldPass`), whose width `[B, T - 1]` the values take.
    Returns `critic/...` metrics; `critic/warmup` is 1.0 when the policy must not update.
    """

    mine, a, c = share.samples, run.cfg.algo, run.cfg.critic
    width = old.logp.shape[1]
    mask = response_mask(mine, width)
    values, routes = run.critic.values(mine.sequences, record_routes=True)
    values = _fit(values, width)
    rewards = token_rewards(mine.rewards.float(), mask)
    lam = length_adaptive_lambda(mask.sum(1), a.lam_alpha) if a.lam == "adaptive" else float(a.lam)
    adv, _ = compute_gae(rewards, values, mask, gamma=a.gamma, lam=lam)
    _, returns = compute_gae(rewards, values, mask, gamma=a.gamma, lam=c.lam)
    if a.whiten_advantages:
        adv = whiten(adv, mask, sums=run.policy.all_reduce_sum)
    mine.advantages = adv
    warmup = step <= c.warmup_steps
    metrics = value_stats(run, values, returns, mask, lam) | {"critic/warmup": float(warmup)}
    metrics |= critic_updates(run, share, values, returns, mask, routes if c.replay == "r2" else None)
    metrics |= critic_volatility(run, mine.sequences, routes)
    if warmup:
        _log_warmup(run, step, metrics)
    return metrics


def _fit(t: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, T']` cut or zero-padded to `[B, width]`."""
    return t[:, :width] if t.shape[1] >= width else torch.nn.functional.pad(t, (0, width - t.shape[1]))


def value_stats(run: Any, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                lam: float | torch.Tensor) -> dict[str, float]:
    """Step-wide (all DP ranks) value and return means, explained variance 1 - Var(R - V) / Var(R)
    of the values before this step's updates, and the policy's mean λ."""
    m = mask.bool()
    v, r = values[m].double(), returns[m].double()
    lam_rows = lam if isinstance(lam, torch.Tensor) else torch.full((mask.shape[0],), float(lam))
    lam_rows = lam_rows[m.any(1)].double()
    s = run.policy.all_reduce_sum(torch.stack([
        torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), r.sum(), r.square().sum(),
        (r - v).sum(), (r - v).square().sum(), lam_rows.sum(), torch.tensor(float(lam_rows.numel()),
                                                                            dtype=torch.float64)]))
    n = max(float(s[0]), 1.0)
    var_r = float(s[3]) / n - (float(s[2]) / n) ** 2
    var_err = float(s[5]) / n - (float(s[4]) / n) ** 2
    return {"critic/value_mean": float(s[1]) / n, "critic/return_mean": float(s[2]) / n,
            "critic/explained_variance": 1.0 - var_err / var_r if var_r > 1e-12 else 0.0,
            "critic/lam_policy_mean": float(s[6]) / max(float(s[7]), 1.0)}


def critic_updates(run: Any, share: Any, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                   routes: torch.Tensor | None) -> dict[str, float]:
    """`critic.updates_per_step` passes over the step's minibatches, one critic optimizer step each."""

    c, critic = run.cfg.critic, run.critic
    extras_all = {"old_values": values, "returns": returns, "mask": mask}
    logged, step_metrics = [], {}
    for _ in range(c.updates_per_step):
        for idx in share.minibatches:
            extras = {k: t[idx] for k, t in extras_all.items()}
            num_tokens = float(critic.all_reduce_sum(extras["mask"].sum().double().view(1))[0])

            def loss(v: torch.Tensor, mb: Any, n: float = num_tokens) -> tuple[torch.Tensor, dict[str, float]]:
                valid = (mb.index >= 0).float().unsqueeze(1)  # rows added to fill the last microbatch
                ex = mb.extras
                return value_loss(v, ex["old_values"], ex["returns"], ex["mask"] * valid, clip=c.value_clip,
                                  global_num_tokens=n)

            out = critic.update([share.samples.sequences[i] for i in idx], extras, loss,
                                replay_routes=None if routes is None else routes[idx])
            step_metrics = out.step
            logged.append(combine_loss_metrics(critic, out.microbatches))
    metrics = mean_metrics(logged)
    metrics.pop("loss/num_tokens", None)
    return metrics | {"critic/grad_norm": step_metrics["perf/grad_norm"], "critic/lr": step_metrics["perf/lr"]}


def critic_volatility(run: Any, sequences: list[torch.Tensor], before: torch.Tensor | None) -> dict[str, float]:
    """The critic's expert volatility across this step's updates, on the step's tokens
    (`critic/drift/volatility...`, as the policy's `drift/volatility`)."""
    if not run.cfg.drift.enabled or before is None:
        return {}
    _, after = run.critic.values(sequences, record_routes=True)
    lengths = torch.tensor([len(s) for s in sequences])
    width = min(before.shape[1], after.shape[1])
    tokens = torch.arange(width).view(1, -1) < (lengths - 1).view(-1, 1)
    stats = route_stats(before[:, :width][tokens], after[:, :width][tokens]).all_reduce(run.critic.dp_group)
    return stats.summary("critic/drift/volatility", list(run.critic.arch.moe_layers))


def _log_warmup(run: Any, step: int, metrics: dict[str, float]) -> None:
    """Value pretraining progress; at its last step, whether the value loss and explained variance settled."""
    history = run.drift_state.setdefault("critic_warmup", [])  # checkpointed with the run's state
    history.append((metrics.get("critic/value_loss", 0.0), metrics["critic/explained_variance"]))
    if run.rank != 0:
        return
    loss, ev = history[-1]
    log.info("value pretraining step %d/%d: value loss %.4g, explained variance %.3f",
             step, run.cfg.critic.warmup_steps, loss, ev)
    if step == run.cfg.critic.warmup_steps and len(history) >= 2:
        first, prev = history[0], history[-2]
        settled = abs(loss - prev[0]) <= 0.1 * max(abs(prev[0]), 1e-8) and abs(ev - prev[1]) <= 0.05
        log.info("value pretraining done: value loss %.4g -> %.4g, explained variance %.3f -> %.3f (%s)",
                 first[0], loss, first[1], ev, "settled" if settled else
                 "still moving: consider more critic.warmup_steps")
