"""One RL step, top to bottom.

    prompts -> rollout engine -> rewards -> advantages and filters
      -> old log-probs (routes recorded for R2, the engine's for R3)
      -> minibatch updates under routing replay -> weight sync -> drift -> metrics

`rl_step` is the algorithm; the updates and the push are below it, each other stage in its
own module: the batch (`run.intake`: rank 0 receives it all, batch.py, or each data-parallel head
its own groups, heads.py; its samples from rollouts.py or async_rollouts.py), the old pass and its
route decisions (old_pass.py), the critic (critic.py) and the drift views (drift_views.py). Every
function runs on every trainer rank: rank 0 decides what is generated and when weights are
pushed, and each data-parallel rank receives and trains on its share of the samples
(moe_rl/samples.py).
"""
from __future__ import annotations

from typing import Any

import torch

from moe_rl.algo.config import loss_reads, ratio_mode, staleness_bound, tis_cap_of
from moe_rl.algo.correction import DEFAULT_BOUNDS
from moe_rl.algo.losses import compute_loss, ntp_loss
from moe_rl.policy.compat import native
from moe_rl.recipes.common import Stopwatch, combine_loss_metrics, mean_metrics
from moe_rl.recipes.rl.critic import critic_step
from moe_rl.recipes.rl.drift_views import PerUpdateVolatility, measure_drift
from moe_rl.recipes.rl.old_pass import OldPass, old_logprobs
from moe_rl.recipes.rl.rollouts import wait_for_prefetch
from moe_rl.recipes.rl.run import Run
from moe_rl.rollout.config import pause_mode
from moe_rl.samples import Samples, Share, engine_logp_tokens, response_mask


def rl_step(run: Run, step: int) -> dict[str, float]:
    """One RL step; returns the step's metrics (identical on every rank)."""
    clock = Stopwatch()
    batch = run.intake.batch(run, step)       # rollouts, rewards, DAPO refills, advantages; this rank: its DP share
    clock.lap("rollout")
    metrics, share = batch.metrics, batch.share
    if share is None:                                             # DAPO: no informative group, step skipped
        return metrics | clock.metrics()
    old = old_logprobs(run, share.samples, step, share.minibatches[0])  # routes recorded (R2) or the engine's (R3)
    clock.lap("old_logprobs")
    if run.critic is not None:                                    # algo.advantage=gae (moe_rl/recipes/rl/critic.py):
        metrics |= critic_step(run, share, old, step)             # values, GAE advantages, critic updates
        clock.lap("critic")
        if metrics["critic/warmup"]:                              # value pretraining: the policy waits
            return metrics | clock.metrics()
    metrics |= minibatch_updates(run, share, old)                 # loss -> backward -> optimizer step
    run.rollouts.observe(step, metrics)                           # algo.auto_staleness: K lowered if they moved too far
    clock.lap("updates")
    run.weight_version += 1
    metrics |= sync_weights(run)                                  # rollout/weight_sync/
    clock.lap("weight_sync")
    metrics |= measure_drift(run, share.samples, old, step)       # drift/
    clock.lap("drift")
    return metrics | clock.metrics() | {"perf/tokens_per_s": batch.tokens / clock.total(),
                                        "perf/weight_version": float(run.weight_version)}


# ---------------------------------------------------------------- the updates

def minibatch_updates(run: Run, share: Share, old: OldPass) -> dict[str, float]:
    """`algo.num_minibatches` optimizer steps, one per minibatch of this rank's share."""
    mine = share.samples
    extras_all = loss_extras(mine, old)
    logged: list[dict[str, float]] = []
    step_metrics: dict[str, float] = {}
    per_update = PerUpdateVolatility(run, mine) if run.cfg.drift.enabled and run.cfg.drift.per_update else None
    for idx in share.minibatches:
        extras = {name: t[idx] for name, t in extras_all.items()}
        counts = run.policy.all_reduce_sum(torch.tensor(
            [extras["mask"].sum(), (extras["mask"].sum(1) > 0).sum(),
             (extras["mask"] * extras["correct"][:, None]).sum()], dtype=torch.float64))
        loss = _loss_fn(run, float(counts[0]), float(counts[1]), float(counts[2]))
        replay = None if old.replay is None else old.replay[idx]
        out = run.policy.update([mine.sequences[i] for i in idx], extras, loss, replay_routes=replay)
        step_metrics = out.step
        logged.append(combine_loss_metrics(run.policy, out.microbatches))
        if per_update:
            per_update.after_update()
    return mean_metrics(logged) | step_metrics | old.metrics | (per_update.metrics() if per_update else {})


def loss_extras(mine: Samples, old: OldPass) -> dict[str, torch.Tensor]:
    """What the loss reads per sample, `[B, T - 1]` (`correct`: `[B]`): pi_old (algo.behaviour), the
    engine's log-probs (the behaviour policy, for the rollout correction), advantages, response mask,
    and the route mask's kept tokens (`route_keep`, 1 everywhere without it)."""
    width = old.logp.shape[1]
    keep = torch.ones(len(mine), width) if old.route_keep is None else old.route_keep.float()
    current = torch.zeros(len(mine)) if old.current is None else old.current.float()
    return {"old_logp": old.logp, "adv": mine.advantages.float(), "mask": response_mask(mine, width),
            "rollout_logp": engine_logp_tokens(mine, width), "correct": (mine.rewards >= 1.0).float(),
            "route_keep": keep, "old_is_current": current}


def _loss_fn(run: Run, num_tokens: float, num_seqs: float, num_correct_tokens: float = 0.0):
    a = run.cfg.algo
    params = loss_params(a)
    corrected = "correction" in params

    def loss(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        valid = (mb.index >= 0).float().unsqueeze(1)  # rows added to fill the last microbatch
        ex = mb.extras
        # the route mask's tokens leave the objective; the normalisers (num_tokens, num_seqs) stay the batch's
        mask = ex["mask"] * valid * ex["route_keep"]
        # rows the old pass skipped (old_pass_after_first): this pass, before its update, is pi_old
        old_logp = torch.where(ex["old_is_current"].unsqueeze(1) > 0, logp.detach(), ex["old_logp"])
        value, metrics = compute_loss(
            a.loss, logp=logp, old_logp=old_logp, advantages=ex["adv"], mask=mask,
            agg=a.aggregation, global_num_tokens=num_tokens, global_num_seqs=num_seqs,
            max_len=run.cfg.rollout.max_new_tokens, rollout_logp=ex["rollout_logp"] if corrected else None,
            beta=a.kl_coef, kl_estimator=a.kl_estimator, **params)
        if a.ntp_coef > 0:  # VAPO: mu * L_NTP, the NLL of the tokens of correct samples
            ntp = ntp_loss(logp, ex["mask"] * valid, ex["correct"] > 0, global_num_tokens=num_correct_tokens)
            value, metrics = value + a.ntp_coef * ntp, metrics | {"loss/ntp_loss": float(ntp.detach())}
        return value, metrics
    return loss


def loss_params(a: Any) -> dict[str, Any]:
    """`compute_loss` keywords from the `algo` section: the objective's hyperparameters and the
    rollout correction (present only when one is on)."""
    # the objective's own hyperparameters, as its registered function declares them; None: its default
    params: dict[str, Any] = {k: getattr(a, k) for k in loss_reads(a.loss) if getattr(a, k) is not None}
    rc, mode = a.rollout_correction, ratio_mode(a.rollout_correction)
    tis_cap = tis_cap_of(a)  # algo.tis_cap, or the stale samples' default when asynchronous
    corrected = tis_cap is not None or mode is not None
    if corrected:
        bounds = None
        if rc.low is not None or rc.high is not None:  # each unset side from the mode's default
            low, high = DEFAULT_BOUNDS[mode]
            bounds = (low if rc.low is None else rc.low, high if rc.high is None else rc.high)
        params |= {"tis_cap": tis_cap, "tis_level": a.tis_level, "correction": mode,
                   "correction_bounds": bounds}
    return params


def sync_weights(run: Run) -> dict[str, float]:
    """Push the updated weights to the rollout engine (collective); the push's `weight_sync/*` metrics
    (senders, the busiest rank's bytes, the share sent by a delta push, the verification's time)."""
    pause = pause_mode(run.cfg.rollout, staleness_bound(run.cfg.algo)) if run.rank == 0 else None
    if pause is None:
        wait_for_prefetch(run)  # it finishes on the weights it started with
    if run.cfg.rollout.colocated and run.rank == 0:
        run.engine.resume_memory_occupation()  # the servers load the new weights into their memory
    if pause:  # the prefetched requests finish under the new weights (partial rollouts)
        run.engine.pause_generation(pause)
    try:
        with native():  # the push names no CUDA device: no detour through megatron's CPU redirect per torch call
            run.weight_sync.sync(run.weight_version, run.policy, run.engine if run.rank == 0 else None)
    finally:
        if pause:
            run.engine.continue_generation()
    run.intake.pushed(run)  # rollout.intake=heads: the heads' clients learn the weights now served
    return dict(getattr(run.weight_sync, "push_metrics", {}))
