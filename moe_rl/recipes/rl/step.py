"""One RL step, top to bottom.

    prompts -> rollout engine -> rewards -> advantages and filters
      -> old log-probs (routes recorded for R2, the engine's for R3)
      -> minibatch updates under routing replay -> weight sync -> drift -> metrics

`rl_step` is the algorithm; the helpers under it each do one stage. Every function
runs on every trainer rank: rank 0 talks to the rollout engine, scores and plans the
step, and each data-parallel rank receives and trains on its share of the samples
(moe_rl/recipes/rl/batch.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moe_rl.algo.config import loss_reads, ratio_mode, route_mask_bound, staleness_bound, tis_cap_of
from moe_rl.algo.correction import DEFAULT_BOUNDS
from moe_rl.algo.losses import compute_loss, ntp_loss
from moe_rl.config import RunConfig, replay_mode
from moe_rl.data.dataset import PromptDataset
from moe_rl.data.sampler import PromptSampler
from moe_rl.drift.metrics import (confidence_summary, expert_load, load_change, load_violation, logprob_mismatch,
                                  route_stats)
from moe_rl.policy.compat import native
from moe_rl.policy.policy import Policy
from moe_rl.recipes.common import Stopwatch, combine_loss_metrics, mean_metrics, probe_routes, probe_volatility
from moe_rl.recipes.rl.async_rollouts import observe_staleness
from moe_rl.recipes.rl.batch import Samples, Share, response_mask, rollout_batch, wait_for_prefetch
from moe_rl.recipes.rl.critic import critic_step
from moe_rl.recipes.rl.replay_health import engine_route_cover, free_pass_due, replay_routes, route_health
from moe_rl.rollout.config import pause_mode
from moe_rl.reward.runner import RewardRunner


@dataclass
class Run:
    """Everything a step needs, built once by the trainer."""

    cfg: RunConfig
    policy: Policy
    dataset: PromptDataset
    sampler: PromptSampler
    rewards: RewardRunner
    engine: Any  # RolloutEngine on rank 0, None elsewhere
    weight_sync: Any
    eos_id: int
    rank: int = 0
    weight_version: int = 0
    drift_state: dict[str, Any] = field(default_factory=dict)
    async_rollouts: Any = None  # rank 0's AsyncRollouts when algo.max_staleness >= 1 (recipes/rl/async_rollouts.py)
    critic: Any = None  # moe_rl.policy.critic.Critic when algo.advantage=gae
    episodes: Any = None  # rank 0's EpisodeRunner when rollout.env is set (moe_rl/rollout/episodes.py)


def rl_step(run: Run, step: int) -> dict[str, float]:
    """One RL step; returns the step's metrics (identical on every rank)."""
    clock = Stopwatch()
    batch = rollout_batch(run, step)          # rank 0: rollouts, rewards, DAPO refills, advantages; this rank: its DP share
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
    observe_staleness(run, step, metrics)                         # algo.auto_staleness: K lowered if they moved too far
    clock.lap("updates")
    run.weight_version += 1
    metrics |= sync_weights(run)                                  # rollout/weight_sync/
    clock.lap("weight_sync")
    metrics |= measure_drift(run, share.samples, old, step)       # drift/
    clock.lap("drift")
    return metrics | clock.metrics() | {"perf/tokens_per_s": batch.tokens / clock.total(),
                                        "perf/weight_version": float(run.weight_version)}


# ---------------------------------------------------------------- policy passes

@dataclass
class OldPass:
    """pi_old of the objective, the trainer's pre-update pass, its own routes, the routes to replay."""

    logp: torch.Tensor                 # [B, T - 1] pi_old, the objective's (algo.behaviour)
    trainer_logp: torch.Tensor | None  # [B, T - 1] the trainer's pass (None: not run)
    free_routes: torch.Tensor | None   # [B, T - 1, L, K] chosen by the trainer's routers
    replay: torch.Tensor | None        # routes replayed in the updates (None = replay off)
    route_keep: torch.Tensor | None = None  # [B, T - 1] bool: the route mask's kept tokens (None: no mask)
    metrics: dict[str, float] = field(default_factory=dict)  # correction/route_* of the route mask
    current: torch.Tensor | None = None  # [B] bool: rows whose pi_old is the first update's own pass


def old_logprobs(run: Run, mine: Samples, step: int, first: list[int] | None = None) -> OldPass:
    """pi_old: the trainer's log-probs of the samples before the step's updates (algo.behaviour=
    recompute), or the engine's (engine); the trainer's own free routes where R2 replays them, this
    step measures drift on its tokens, the route mask compares them with the engine's, or R3 checks
    the engine's layers (moe_rl/recipes/rl/replay_health.py). With behaviour=engine the pass runs
    only for those routes.

    `first`: the rows of the step's first update. When pi_old is all the trainer's pass is for, it
    skips them: the first update's forward runs the same weights on them before its optimizer step,
    so its own log-probs, detached, are pi_old there (`OldPass.current`; TRL does the same)."""
    mode, drift, masking = replay_mode(run.cfg.algo), step_drift_due(run, step), route_mask_bound(run.cfg.algo)
    engine_pi = run.cfg.algo.behaviour == "engine"
    width = max(mine.lengths()) - 1
    engine = engine_route_cover(mine, width) if mode == "r3" or masking is not None else None
    free_due = drift or masking is not None or (mode == "r3" and free_pass_due(run))
    if engine_pi and mode != "r2" and not free_due:      # nothing needs the trainer: no pass
        return OldPass(engine_logp_tokens(mine, width), None, None, engine.routes if mode == "r3" else None)
    if first is not None and mode == "off" and not free_due and not engine_pi:  # pi_old alone
        return old_pass_after_first(run, mine, first, width)
    if mode == "r3":
        free = run.policy.logprobs(mine.sequences, record_routes=True).routes if free_due else None
        replay = replay_routes(engine, free)          # the engine's; the trainer's own where it has none
        old = run.policy.logprobs(mine.sequences, replay_routes=replay)
    else:
        old = run.policy.logprobs(mine.sequences, record_routes=free_due or mode == "r2")
        free, replay = old.routes, old.routes if mode == "r2" else None
    health = route_health(run, mine, engine, free, response_mask(mine, width).bool())
    pi_old = engine_logp_tokens(mine, old.logp.shape[1]) if engine_pi else old.logp
    return OldPass(pi_old, old.logp, free, replay, health.keep, health.metrics)


def old_pass_after_first(run: Run, mine: Samples, first: list[int], width: int) -> OldPass:
    """pi_old of the rows after the first update's (a pass only with algo.num_minibatches > 1, the
    same on every rank); the first update's rows are `current`, their `logp` a placeholder."""
    current = torch.zeros(len(mine), dtype=torch.bool)
    current[first] = True
    logp = torch.zeros(len(mine), width)
    rest = (~current).nonzero().flatten().tolist()
    if rest:
        got = run.policy.logprobs([mine.sequences[i] for i in rest]).logp
        logp[rest, : got.shape[1]] = got
    return OldPass(logp, None, None, None, current=current)


def engine_routes(samples: Samples) -> torch.Tensor:
    """Engine routes stacked to `[B, T - 1, L, K]` (R3), zeros where a sample has none (see
    replay_health.engine_route_cover for where it has). The engine's compact id dtype (uint8 for
    <= 256 experts) is kept: the replay hook widens one microbatch's ids at a time."""
    return engine_route_cover(samples, max(samples.lengths()) - 1).routes


def engine_logp_tokens(samples: Samples, width: int) -> torch.Tensor:
    """Engine log-probs placed at the positions that predict them: `[B, width]`."""
    out = torch.zeros(len(samples), width)
    for i, (p, lp) in enumerate(zip(samples.prompt_lens.tolist(), samples.engine_logp)):
        out[i, p - 1: p - 1 + lp.shape[0]] = lp[: max(width - p + 1, 0)]
    return out


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
    return dict(getattr(run.weight_sync, "push_metrics", {}))


# ---------------------------------------------------------------- drift

def measure_drift(run: Run, mine: Samples, old: OldPass, step: int) -> dict[str, float]:
    """Route volatility across the step's updates, engine-vs-trainer mismatch, expert load, probe set."""
    d = run.cfg.drift
    if not d.enabled:
        return {}
    out = probe_drift(run, mine, step) if step % d.probe_every == 0 else {}
    if staleness_bound(run.cfg.algo):
        out |= volatility_by_staleness(run, mine)
    if step_drift_due(run, step):
        out |= step_drift(run, mine, old)
    return out


def step_drift_due(run: Run, step: int) -> bool:
    """Whether this step measures drift on its own tokens (`step_drift`, every `drift.every` steps)."""
    d = run.cfg.drift
    return d.enabled and d.step_tokens and step % d.every == 0


def probe_set(run: Run, mine: Samples) -> list[torch.Tensor]:
    """The fixed probe sequences: this rank's first samples of the first step that measured drift."""
    state = run.drift_state
    if "probe" not in state:
        state["probe"] = [s.clone() for s in mine.sequences[: run.cfg.drift.probe_size]]
    return state["probe"]


def probe_drift(run: Run, mine: Samples, step: int) -> dict[str, float]:
    """Volatility on the probe set since the last probe (`drift.probe_every` steps)."""
    probe_set(run, mine)
    return probe_volatility(run.policy, run.drift_state)


def volatility_by_staleness(run: Run, mine: Samples) -> dict[str, float]:
    """`drift/volatility_by_staleness/k`, k = 1..algo.max_staleness: the trainer's routes on the probe
    set under the weights just pushed against its routes under the weights k versions before, per
    layer; how far routing moves across the versions a trained token may be behind. One probe
    forward per step keeps the routes of the last K versions (`drift_state["probe_history"]`)."""
    history = run.drift_state.setdefault("probe_history", [])  # oldest first, one per version
    routes = probe_routes(run.policy, probe_set(run, mine))
    out: dict[str, float] = {}
    for k, past in enumerate(reversed(history), start=1):
        out |= route_stats(past, routes).all_reduce(run.policy.dp_group).summary(
            f"drift/volatility_by_staleness/{k}", list(run.policy.arch.moe_layers))
    history.append(routes)
    del history[:-staleness_bound(run.cfg.algo)]
    return out


class PerUpdateVolatility:
    """Probe-set volatility across each optimizer update of a step, averaged over the step's
    updates (`drift/volatility_per_update`); `drift/volatility` spans all of them."""

    def __init__(self, run: Run, mine: Samples) -> None:
        self.policy, self.probe = run.policy, probe_set(run, mine)
        self.routes = probe_routes(self.policy, self.probe)
        self.stats: Any = None

    def after_update(self) -> None:
        routes = probe_routes(self.policy, self.probe)
        stats = route_stats(self.routes, routes)
        self.stats, self.routes = stats if self.stats is None else self.stats + stats, routes

    def metrics(self) -> dict[str, float]:
        return self.stats.all_reduce(self.policy.dp_group).summary(
            "drift/volatility_per_update", list(self.policy.arch.moe_layers))


def step_drift(run: Run, mine: Samples, old: OldPass) -> dict[str, float]:
    """Drift on the step's own tokens: before the first vs after the last optimizer step."""
    arch = run.policy.arch
    width = old.logp.shape[1]
    lengths = torch.tensor(mine.lengths())
    tokens = torch.arange(width).view(1, -1) < (lengths - 1).view(-1, 1)  # every routed token
    passed = run.policy.logprobs(mine.sequences, record_routes=True, route_confidence=True)
    after = passed.routes
    flat = lambda r: r[:, :width][tokens]  # noqa: E731  [N, L, K]
    layer_ids = list(arch.moe_layers)
    trainer, after = flat(old.free_routes), flat(after)  # the routed tokens' routes before / after the updates
    out = route_stats(trainer, after).all_reduce(run.policy.dp_group).summary("drift/volatility", layer_ids)
    conf = flat(passed.route_confidence).double()  # [N, L, 2]
    sums = run.policy.all_reduce_sum(torch.cat([conf.sum(0).flatten(), torch.tensor([float(conf.shape[0])])]))
    out |= confidence_summary(sums[:-1].view(-1, 2), float(sums[-1]), layer_ids)
    resp, engine_logp = response_mask(mine, width).bool(), engine_logp_tokens(mine, width)
    engine, have = None, None
    if mine.routes is not None and any(r is not None for r in mine.routes):
        cover = engine_route_cover(mine, width)
        engine, have = flat(cover.routes), flat(cover.covered).all(-1)  # tokens the engine has routes for
        out |= route_stats(engine, trainer, mask=have).all_reduce(run.policy.dp_group).summary(
            "drift/rollout_mismatch", layer_ids)
        if mine.versions is not None and staleness_bound(run.cfg.algo):
            out |= drift_by_staleness(run, mine, old, engine, trainer, tokens, resp, engine_logp, have)
    if mine.action_masks is not None:  # multi-turn episodes: late turns are where off-policy routing compounds
        out |= drift_by_turn(run, mine, old, trainer, after, engine, tokens, resp, engine_logp, have)
    out |= logprob_mismatch(old.trainer_logp[resp], engine_logp[resp]).all_reduce(run.policy.dp_group).summary()
    load = run.policy.all_reduce_sum(expert_load(after, arch.num_moe_experts).to(torch.float64))
    out |= load_violation(load, layer_ids)
    if "load" in run.drift_state:
        out |= load_change(run.drift_state["load"], load, layer_ids)
    run.drift_state["load"] = load
    return out


def position_lags(mine: Samples, width: int, version: int, *, retracted: bool = False) -> torch.Tensor:
    """`[B, width]`: how many versions behind `version` the weights were that computed each position.
    Position t >= P - 1 is the forward that produced completion token t - P + 1 (its route and the
    log-prob of that token); the prompt's positions, the prefill, go with the first; -1 past the sample.
    `retracted`: the routes of samples whose every push retracted them (rollout.inflight_update=retract):
    each push prefilled all earlier positions again, so every route is the last version's."""
    out = torch.full((len(mine), width), -1, dtype=torch.long)
    for i, (p, v) in enumerate(zip(mine.prompt_lens.tolist(), mine.versions)):
        if v.numel():
            lag = version - v.long()
            lag = lag[-1:].expand_as(lag) if retracted else lag
            end = min(p - 1 + lag.numel(), width)
            out[i, :max(p - 1, 0)] = lag[0]
            out[i, p - 1:end] = lag[: end - (p - 1)]
    return out


def drift_by_staleness(run: Run, mine: Samples, old: OldPass, engine: torch.Tensor, trainer: torch.Tensor,
                       tokens: torch.Tensor, resp: torch.Tensor, engine_logp: torch.Tensor,
                       have: torch.Tensor) -> dict[str, float]:
    """Engine-vs-trainer routes (`engine`, `trainer`: [N, L, K] of the routed `tokens`) and log-probs
    (`old.trainer_logp`, `engine_logp`: [B, width]) of the step's tokens by k = 0..algo.max_staleness, how many
    versions older than the old pass's (this step's weights before its updates) the weights that
    generated them were: how far an MoE's routing moves per version of staleness. `have` [N]: the
    routed tokens with an engine route."""
    version, width, k_max = run.weight_version - 1, resp.shape[1], staleness_bound(run.cfg.algo)
    lags, out = position_lags(mine, width, version), {}
    route_lags = position_lags(mine, width, version, retracted=pause_mode(run.cfg.rollout, k_max) == "retract")
    for k in range(k_max + 1):
        at_lag = (route_lags[tokens] == k) & have
        out |= route_stats(engine, trainer, mask=at_lag).all_reduce(run.policy.dp_group).summary(
            f"drift/rollout_mismatch_by_staleness/{k}", list(run.policy.arch.moe_layers))
        at = resp & (lags == k)
        logp = logprob_mismatch(old.trainer_logp[at], engine_logp[at]).all_reduce(run.policy.dp_group).summary("x")
        out |= {f"drift/logp_by_staleness/{k}/{name[2:]}": v for name, v in logp.items()}
    return out


def position_turns(mine: Samples, width: int) -> torch.Tensor:
    """`[B, width]`: the episode turn of the token at each position: the prompt's and an environment's
    opening ids turn 0, model turn t's tokens and the environment's answer to them turn t; -1 past it."""
    out = torch.full((len(mine), width), -1, dtype=torch.long)
    for i, (p, action, n) in enumerate(zip(mine.prompt_lens.tolist(), mine.action_masks, mine.lengths())):
        starts = action & ~torch.cat([torch.zeros(1, dtype=torch.bool), action[:-1]])  # a model turn begins
        turn = (starts.long().cumsum(0) - 1).clamp(min=0)
        out[i, :min(p, width)] = 0
        out[i, p:min(n, width)] = turn[: max(min(n, width) - p, 0)]
    return out


CONTEXT, NO_ROW = -1, -2  # route_turns' values for rows of no model turn, and for positions past a sample


def route_turns(mine: Samples, width: int) -> torch.Tensor:
    """`[B, width]`: the model turn each route row counts for in `drift_by_turn`.

    Row t is the forward of token t and computes the distribution of token t + 1, which is where
    routing acts on the model's actions: a row counts as model turn k when token t + 1 is one of
    turn k's tokens (the forwards turn k's tokens were sampled from, from the last token before the
    turn to its last but one; the rows of the response mask, as `drift/logp_by_turn`). A row whose
    next token is the prompt's or an environment's reads context forward and samples nothing (the
    prompt's positions but its last, each turn's last token, an answer's tokens but its last): it
    counts as CONTEXT, in no turn, so that a turn's figures are its own tokens' and not the prompt's
    or the tool output's. NO_ROW past each sample's routed positions (its last token has no row).
    (Counting a row as the turn of its own token instead would leave a turn that ends the episode
    with one token, its last, without a row, and put the prompt's rows into turn 0.)
    """
    routed = torch.arange(width).view(1, -1) < (torch.tensor(mine.lengths()) - 1).view(-1, 1)
    own = position_turns(mine, width + 1)[:, 1:]  # the turn of token t + 1 (model tokens'; context's aside)
    return torch.where(response_mask(mine, width).bool(), own, torch.where(routed, CONTEXT, NO_ROW))


def drift_by_turn(run: Run, mine: Samples, old: OldPass, before: torch.Tensor, after: torch.Tensor,
                  engine: torch.Tensor | None, tokens: torch.Tensor, resp: torch.Tensor,
                  engine_logp: torch.Tensor, have: torch.Tensor | None = None) -> dict[str, float]:
    """By episode turn t = 0..rollout.max_turns - 1: the step's volatility (`before` / `after` the
    updates: [N, L, K] of the routed `tokens`), the engine-vs-trainer route mismatch (`engine` vs
    `before`, None without engine routes; `have` [N]: the tokens it has routes for) and log-prob mismatch
    of the model's tokens of turn t; the rows of the prompt and the environment's answers apart, as
    `drift/*_by_turn/context` (which rows count where: `route_turns`)."""
    width, layers, group = resp.shape[1], list(run.policy.arch.moe_layers), run.policy.dp_group
    rows = route_turns(mine, width)
    routed = rows[tokens]  # the turn of each routed token's row, as `before` / `after` / `engine` are ordered
    out = {}
    for t, name in [(t, str(t)) for t in range(run.cfg.rollout.max_turns)] + [(CONTEXT, "context")]:
        out |= route_stats(before, after, mask=routed == t).all_reduce(group).summary(
            f"drift/volatility_by_turn/{name}", layers)
        if engine is not None:
            out |= route_stats(engine, before, mask=(routed == t) & have).all_reduce(group).summary(
                f"drift/rollout_mismatch_by_turn/{name}", layers)
        if t != CONTEXT:  # the context's tokens were not sampled: no log-probs to compare
            at = rows == t
            logp = logprob_mismatch(old.trainer_logp[at], engine_logp[at]).all_reduce(group).summary("x")
            out |= {f"drift/logp_by_turn/{t}/{key[2:]}": v for key, v in logp.items()}
    return out
