"""The step's batch: rollouts (moe_rl/recipes/rl/rollouts.py) -> rewards -> DAPO refills -> advantages
-> each data-parallel rank's share (moe_rl/samples.py).

Under `rollout.intake=rank0` all of it runs on trainer rank 0, which alone talks to the rollout
engine: the reward functions run once, where the samples are, and no other rank holds the whole
step. (Under `heads`, moe_rl/recipes/rl/heads.py, each data-parallel head runs these stages on its
own groups, and the metrics come from every head's `sample_stats`.) Rank 0 then plans every
data-parallel rank's share (its minibatch rows) and hands each share out (`rollout_batch`, over
`moe_rl.dist.collectives.share_out`): a share goes once to the first rank of its model-parallel
group, which passes it on to its TP x PP peers, so each rank receives 1/DP of the step's
samples and routes, and rank 0 pickles each share once. A failure on rank 0 (no server answered,
a reward that raised) reaches every rank in the same hand-off, and every rank stops there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_rl.algo.advantages import compute_advantages
from moe_rl.algo.config import advantage_params, replay_mode, staleness_bound, uses_critic
from moe_rl.algo.filters import dynamic_sampling, shape_overlong_rewards
from moe_rl.data.dataset import PromptDataset
from moe_rl.dist.collectives import broadcast_object, share_out
from moe_rl.recipes.rl.async_rollouts import check_staleness
from moe_rl.recipes.rl.replay_health import coverage
from moe_rl.recipes.rl.rollouts import generate, next_prompts, rollout, wait_for_prefetch
from moe_rl.rollout.outage import attempt, unwrap
from moe_rl.samples import Samples, Share, response_mask, split, usable_groups


# ---------------------------------------------------------------- rewards and advantages

def task_rewards(run: Any, samples: Samples) -> torch.Tensor:
    """`[N]`: the episodes' rewards from their environment (rollout.env), else the reward function's."""
    if samples.env_rewards is not None:
        return samples.env_rewards.clone()
    return torch.tensor(run.rewards.score(samples.prompts, samples.completions, samples.completion_ids()),
                        dtype=torch.float32)


def score(run: Any, samples: Samples) -> dict[str, float]:
    """Task rewards of every sample, and the step's reward, rollout and staleness metrics of them."""
    st = scored_stats(run, samples)
    return score_metrics(st, float(run.rewards.failures)) | staleness_of(st)


def scored_stats(run: Any, samples: Samples) -> dict[str, torch.Tensor]:
    """Task rewards of every sample (set on them), and the samples' `sample_stats`."""
    samples.rewards = task_rewards(run, samples)
    return sample_stats(samples, run.weight_version)


def sample_stats(samples: Samples, version: int | None = None) -> dict[str, torch.Tensor]:
    """Per sample, what the step's reward, rollout and staleness metrics are made of (`[N]` each,
    float64): a few numbers a sample, so the ranks that receive parts of a step can share them and
    compute the same metrics as one process holding it all (`score_metrics`, `staleness_of`).
    `version`: the trainer's weight version (the staleness columns; None: none)."""
    masks = samples.action_masks or [None] * len(samples)
    picked = [lp if m is None else lp[m[: lp.shape[0]].bool()] for lp, m in zip(samples.engine_logp, masks)]
    col = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    out = {"response_len": (torch.tensor(samples.lengths()) - samples.prompt_lens).double(),
           "logp_sum": col([float(p.double().sum()) for p in picked]), "logp_tokens": col([p.numel() for p in picked])}
    if samples.rewards is not None:
        out["reward"] = samples.rewards.double()
    if samples.action_masks is not None and samples.turns is not None:
        out |= {"env_tokens": col([int((~a).sum()) for a in samples.action_masks]), "turns": samples.turns.double()}
    if version is not None and samples.versions is not None:
        lags = [version - v.double() for v in samples.versions]
        out |= {"lag_sum": col([float(x.sum()) for x in lags]), "lag_tokens": col([x.numel() for x in lags]),
                "lag_max": col([float(x.max()) if x.numel() else float("-inf") for x in lags]),
                "partial": col([bool(v.numel()) and bool((v != v[0]).any()) for v in samples.versions])}
    return out


def merge_stats(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The step's stats from its parts', in order (a column some part lacks is left out)."""
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    return {k: torch.cat([p[k] for p in parts]) for k in keys}


def score_metrics(st: dict[str, torch.Tensor], failures: float) -> dict[str, float]:
    """The step's reward and rollout metrics from its samples' stats (`sample_stats`)."""
    rewards, lengths = st["reward"], st["response_len"]
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
           "reward/min": float(rewards.min()), "reward/max": float(rewards.max()),  # the report's band stays inside
           "reward/success_rate": float((rewards >= 1.0).double().mean()),
           "reward/failures": failures,
           "rollout/response_len": float(lengths.mean()),
           "rollout/entropy": entropy_of(st)}
    if "env_tokens" in st:  # multi-turn: how many turns, how much of the context is the environment's
        out |= {"rollout/turns_mean": float(st["turns"].mean()),
                "rollout/env_token_frac": float(st["env_tokens"].sum()) / max(1, int(lengths.sum()))}
    return out


def entropy_of(st: dict[str, torch.Tensor]) -> float:
    """Mean -log pi_engine over the sampled response tokens (the model's, not an environment's): an
    unbiased estimate of the sampling policy's per-token entropy, E_a[-log pi(a)] = H(pi), free because
    the engine returns the log-probs. Near 0: the policy samples one answer (the collapse alarm's floor,
    drift.alarm.collapse_entropy). NaN without tokens."""
    tokens = float(st["logp_tokens"].sum())
    return -float(st["logp_sum"].sum()) / tokens if tokens else float("nan")


def staleness_of(st: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per token, how many weight versions the weights that generated it are behind the trainer's;
    and the share of samples whose tokens come from more than one version (partial rollouts). Empty
    when the engine reports no versions."""
    if "lag_tokens" not in st or not float(st["lag_tokens"].sum()):
        return {}
    return {"rollout/staleness_mean": float(st["lag_sum"].sum() / st["lag_tokens"].sum()),
            "rollout/staleness_max": float(st["lag_max"].max()), "rollout/partial_frac": float(st["partial"].mean())}


def dynamic_sampling_rounds(run: Any, samples: Samples, step: int) -> tuple[Samples | None, dict[str, float]]:
    """DAPO's dynamic sampling: keep the groups whose task rewards differ, generating further
    rounds of prompts until `data.prompts_per_step` groups are kept or
    `algo.dynamic_sampling_max_rounds` rounds were generated. Returns the kept samples (the
    most whole groups that split evenly over DP ranks x minibatches; None when there are none).

    Refill rounds are generated with the current weights (under off-policy overlap, after the
    prefetched rollout has finished).
    """
    a, g, want = run.cfg.algo, run.cfg.rollout.n_samples, run.cfg.data.prompts_per_step
    if not a.dynamic_sampling:
        return samples, {}
    informative = lambda s: s.select(dynamic_sampling(s.rewards, group_size=g).keep.tolist())  # noqa: E731
    kept, generated, rounds = informative(samples), len(samples) // g, 1
    while len(kept) < want * g and rounds < a.dynamic_sampling_max_rounds:
        wait_for_prefetch(run)
        more = generate(run, next_prompts(run), step)
        score(run, more)
        kept, generated, rounds = kept + informative(more), generated + len(more) // g, rounds + 1
    use = usable_groups(min(len(kept) // g, want), g, run.policy.dp_size * a.num_minibatches)
    metrics = {"filter/rounds": float(rounds), "filter/generated_groups": float(generated),
               "filter/kept_groups": float(use), "filter/dropped_groups": float(generated - use)}
    if use == 0:
        return None, metrics | {"filter/skipped_step": 1.0}
    return kept.select(list(range(use * g))), metrics


def advantages_and_filters(run: Any, samples: Samples | None) -> tuple[Samples | None, dict[str, float]]:
    """Overlong shaping of the task rewards (DAPO), then group advantages (None: step skipped)."""
    a, g = run.cfg.algo, run.cfg.rollout.n_samples
    if samples is None:
        return None, {}
    rewards = samples.rewards
    if a.overlong_max_len:
        lengths = torch.tensor(samples.lengths()) - samples.prompt_lens
        rewards = shape_overlong_rewards(rewards, lengths, max_len=a.overlong_max_len,
                                         cache_len=a.overlong_cache_len)
    samples.rewards = rewards
    if uses_critic(a):  # per-token advantages come from the critic, after the old pass
        return samples, {}
    samples.advantages = compute_advantages(a.advantage, rewards, group_size=g, **advantage_params(a))
    return samples, advantage_metrics(rewards, samples.advantages, g)


def advantage_metrics(rewards: torch.Tensor, advantages: torch.Tensor, group_size: int) -> dict[str, float]:
    """The advantages' size, and the share of groups whose rewards all agree (they teach nothing:
    advantages 0); `rewards` in the step's order, G consecutive per group."""
    groups = rewards.reshape(-1, group_size)
    return {"adv/abs_mean": float(advantages.double().abs().mean()),
            "adv/uniform_groups": float((groups == groups[:, :1]).all(1).double().mean())}


def my_share(run: Any, samples: Samples, step: int, dp_rank: int | None = None) -> Share:
    """DP rank `dp_rank`'s (default: this rank's) share of the samples, minibatch by minibatch
    (`algo.shuffle_minibatches`: taken from the samples in the step's seeded random order)."""
    return split(samples, run.policy.dp_size, run.policy.dp_rank if dp_rank is None else dp_rank,
                 run.cfg.algo.num_minibatches, run.policy.packs_sequences, minibatch_order(run, step))


def minibatch_order(run: Any, step: int) -> str | None:
    """The key of the step's seeded minibatch order (`algo.shuffle_minibatches`; None: the samples' order)."""
    return f"moe_rl.minibatches:{run.cfg.data.shuffle_seed}:{step}" if run.cfg.algo.shuffle_minibatches else None


def replay_coverage(run: Any, samples: Samples) -> dict[str, float]:
    """Rank 0, under R3: the share of the step's tokens that replay an engine route (replay/coverage*),
    failing below algo.replay_min_coverage before any rank trains (moe_rl/recipes/rl/replay_health.py)."""
    if replay_mode(run.cfg.algo) != "r3":
        return {}
    arch, width = run.policy.arch, max(samples.lengths()) - 1
    return coverage(samples, response_mask(samples, width).bool(), list(arch.moe_layers),
                    run.cfg.algo.replay_min_coverage)


# ---------------------------------------------------------------- the hand-off

@dataclass
class StepBatch:
    """What a rank gets of the step: the step's metrics (the same on every rank), its share (None:
    the step is skipped, DAPO found no group to train on) and the step's token count."""

    metrics: dict[str, float]
    share: Share | None
    tokens: int = 0


def plan_step(run: Any, step: int) -> dict[int, StepBatch]:
    """Rank 0: the step's samples, rewards, refills and advantages, as each DP rank's batch."""
    samples, staleness, metrics = rollout(run, step)              # data/ -> rollout engine
    metrics |= score(run, samples) | {"rollout/staleness": float(staleness)}
    check_staleness(metrics, staleness_bound(run.cfg.algo))
    samples, more = dynamic_sampling_rounds(run, samples, step)  # DAPO: refill with informative groups
    metrics |= more
    samples, more = advantages_and_filters(run, samples)          # algo/advantages.py, algo/filters.py
    metrics |= more
    dp = run.policy.dp_size
    if samples is None:
        return {d: StepBatch(metrics, None) for d in range(dp)}
    metrics |= replay_coverage(run, samples)                      # R3: every token replays an engine route
    tokens = sum(samples.lengths())
    return {d: StepBatch(metrics, my_share(run, samples, step, d), tokens) for d in range(dp)}


def rollout_batch(run: Any, step: int) -> StepBatch:
    """This rank's part of the step (collective: rank 0 plans, every rank receives only its DP share)."""
    plans = attempt(lambda: plan_step(run, step)) if run.rank == 0 else None
    if run.rank == 0 and not isinstance(plans, dict):  # a failure: the same for every rank
        plans = {d: plans for d in range(run.policy.dp_size)}
    return unwrap(share_out(plans, run.policy.dp_rank, run.policy.model_parallel_ranks))


class RankZeroIntake:
    """`rollout.intake=rank0`: rank 0 receives the whole step and hands each rank its share
    (`rollout_batch`); the other intake, each data-parallel head receiving its own groups, is
    moe_rl/recipes/rl/heads.py."""

    def batch(self, run: Any, step: int) -> StepBatch:
        return rollout_batch(run, step)

    def pushed(self, run: Any) -> None:
        """Rank 0's client made the push: nothing to tell."""


def evaluate(run: Any, dataset: PromptDataset, step: int) -> dict[str, float]:
    """Greedy success rate on a held-out prompt set (rank 0 generates and scores, every rank gets it)."""
    def on_rank0() -> dict[str, float]:
        samples = generate(run, list(dataset), step, greedy=True)
        rewards = task_rewards(run, samples)
        return {"eval/success_rate": float((rewards >= 1.0).float().mean()),
                "eval/reward_mean": float(rewards.mean())}
    return unwrap(broadcast_object(attempt(on_rank0) if run.rank == 0 else None))
