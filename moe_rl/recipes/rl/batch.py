"""The step's batch: prompts -> rollout engine -> rewards -> DAPO refills -> advantages -> each
data-parallel rank's share.

All of it runs on trainer rank 0, which alone talks to the rollout engine: the reward functions
run once, where the samples are, and no other rank holds the whole step. Rank 0 then plans every
data-parallel rank's share (its minibatch rows) and hands each share out (`rollout_batch`, over
`moe_rl.dist.collectives.share_out`): a share goes once to the first rank of its model-parallel
group, which passes it on to its TP x PP peers, so each rank receives 1/DP of the step's
samples and routes, and rank 0 pickles each share once. A failure on rank 0 (no server answered,
a reward that raised) reaches every rank in the same hand-off, and every rank stops there.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from moe_rl.algo.advantages import compute_advantages
from moe_rl.algo.config import replay_mode, staleness_bound
from moe_rl.algo.filters import dynamic_sampling, shape_overlong_rewards
from moe_rl.data.balance import balanced_shards
from moe_rl.data.dataset import Prompt, PromptDataset
from moe_rl.data.sampler import seeded_shuffle
from moe_rl.dist.collectives import broadcast_object, share_out
from moe_rl.recipes.rl.async_rollouts import check_staleness
from moe_rl.recipes.rl.replay_health import coverage
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.outage import attempt, unwrap


@dataclass
class Samples:
    """The step's samples in prompt-major order (G consecutive samples per prompt).

    sequences: prompt + completion ids, each `[T_i]`; prompt_lens: `[N]`;
    engine_logp: per completion token, each `[T_i - P_i]`; routes: engine routes,
    each `[T_i - 1, L, K]` in the engine's compact id dtype (None when the engine does
    not return them); completions: the text before EOS; rewards: the task's `[N]`;
    versions: the weight version each completion token was generated with, each `[T_i - P_i]`
    int32 (SGLang's weight_versions spans; None when the engine does not say).
    Multi-turn episodes (`rollout.env`, moe_rl/rollout/episodes.py): action_masks, each `[T_i - P_i]`
    bool, True at the model's tokens and False at the environment's (masked out of the loss);
    env_rewards `[N]` the episodes' rewards; turns `[N]` their model turns. None for single turns.
    """

    prompts: list[Prompt]
    sequences: list[torch.Tensor]
    prompt_lens: torch.Tensor
    engine_logp: list[torch.Tensor]
    routes: list[torch.Tensor] | None
    completions: list[str]
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    versions: list[torch.Tensor] | None = None
    action_masks: list[torch.Tensor] | None = None
    env_rewards: torch.Tensor | None = None
    turns: torch.Tensor | None = None

    def select(self, idx: list[int]) -> "Samples":
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        rows = lambda t: None if t is None else t[idx]  # noqa: E731
        return Samples([self.prompts[i] for i in idx], pick(self.sequences), self.prompt_lens[idx],
                       pick(self.engine_logp), pick(self.routes), pick(self.completions), rows(self.rewards),
                       rows(self.advantages), pick(self.versions), pick(self.action_masks), rows(self.env_rewards),
                       rows(self.turns))

    def lengths(self) -> list[int]:
        """Each sequence's length T_i (`shape[0]`: `len()` of a tensor costs several times more)."""
        return [s.shape[0] for s in self.sequences]

    def completion_ids(self) -> list[list[int]]:
        """Each sample's generated ids, as the engine returned them (a stop token included)."""
        return [s[p:].tolist() for s, p in zip(self.sequences, self.prompt_lens.tolist())]

    def __add__(self, other: "Samples") -> "Samples":
        both = lambda a, b: None if a is None or b is None else a + b  # noqa: E731
        cat = lambda a, b: None if a is None or b is None else torch.cat([a, b])  # noqa: E731
        return Samples(self.prompts + other.prompts, self.sequences + other.sequences,
                       torch.cat([self.prompt_lens, other.prompt_lens]), self.engine_logp + other.engine_logp,
                       both(self.routes, other.routes), self.completions + other.completions,
                       cat(self.rewards, other.rewards), cat(self.advantages, other.advantages),
                       both(self.versions, other.versions), both(self.action_masks, other.action_masks),
                       cat(self.env_rewards, other.env_rewards), cat(self.turns, other.turns))

    def __len__(self) -> int:
        return len(self.sequences)



# ---------------------------------------------------------------- prompts and rollouts (rank 0)

def next_prompts(run: Any) -> list[Prompt]:
    """The step's next prompts (rank 0 draws them: it alone generates)."""
    return [run.dataset[i] for i in run.sampler.next_batch()]


def sampling_params(run: Any, seed: int | None, greedy: bool = False) -> SamplingParams:
    r = run.cfg.rollout
    return SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop_token_ids=(run.eos_id,),
                          n=1 if greedy else r.n_samples, seed=seed)


def rollout(run: Any, step: int) -> tuple[Samples, int, dict[str, float]]:
    """The step's samples, how many weight versions behind the trainer they were asked for, and
    the asynchronous rollouts' metrics.

    With `algo.max_staleness` = K >= 1 the engine generates the next K steps' samples while
    this step trains (rank 0's `run.async_rollouts`, moe_rl/recipes/rl/async_rollouts.py), so a step
    trains on samples from weights up to K updates old; the trainer's recomputed old log-probs
    and the truncated IS correction (`algo.tis_cap`) account for the difference.
    """
    if run.async_rollouts is None:
        samples, staleness, metrics = generate(run, next_prompts(run), step), 0, {}
    else:
        samples, staleness, metrics = run.async_rollouts.take(run, step, _request, _samples, next_prompts)
    take = getattr(run.engine, "take_stale_resamples", None)  # SGLang servers: samples from other weights
    if take is not None:
        metrics["rollout/stale_resamples"] = float(take())
    return samples, staleness, metrics


def generate(run: Any, prompts: list[Prompt], step: int, greedy: bool = False) -> Samples:
    """Rank 0 asks the engine for G samples per prompt (RolloutError when no server answers)."""
    return _samples(run, prompts, _request(run, prompts, step, greedy))


def _request(run: Any, prompts: list[Prompt], step: int, greedy: bool) -> list:
    """Rank 0: the engine's outputs as plain Python data."""
    base = run.cfg.model.seed * 1_000_003 + step * 10_007
    requests = [GenerateRequest(prompt_ids=list(p.prompt_ids),
                                sampling=sampling_params(run, base + i * 101, greedy),
                                return_routed_experts=run.cfg.rollout.return_routed_experts)
                for i, p in enumerate(prompts)]
    # resumes colocated servers released by the last call; rollout.env: each sample an episode of turns
    results = run.engine.generate(requests) if run.episodes is None else \
        run.episodes.generate(run.engine, prompts, requests)
    if run.cfg.rollout.colocated:
        run.engine.release_memory_occupation()  # training gets the GPU memory back
    episode = lambda r: () if r.action_mask is None else (r.action_mask, r.reward, r.turns)  # noqa: E731
    return [[(r.output_ids, r.output_logprobs, r.routed_experts, r.token_versions(), *episode(r)) for r in per_prompt]
            for per_prompt in results]


def _samples(run: Any, prompts: list[Prompt], payload: list) -> Samples:
    seqs, plens, logps, routes, texts, owners, versions = [], [], [], [], [], [], []
    actions, env_rewards, turns = [], [], []
    decode = getattr(run.dataset.tokenizer, "decode", None)
    for prompt, per_prompt in zip(prompts, payload):
        for out_ids, out_logp, rts, token_versions, *episode in per_prompt:
            action, reward, n_turns = episode or (None, None, 1)  # an episode's mask, reward and turns
            actions.append(None if action is None else torch.tensor(action, dtype=torch.bool))
            env_rewards.append(reward)
            turns.append(n_turns)
            ids = list(out_ids)
            # an episode's text: its model's last turn, after the environment's last answer (for logs)
            body_from = len(action) - action[::-1].index(False) if action is not None and False in action else 0
            seqs.append(torch.tensor(list(prompt.prompt_ids) + ids, dtype=torch.long))
            plens.append(len(prompt.prompt_ids))
            logps.append(torch.as_tensor(out_logp, dtype=torch.float32))
            routes.append(None if rts is None else torch.as_tensor(rts))
            body = ids[body_from:]
            body = body[: body.index(run.eos_id)] if run.eos_id in body else body
            texts.append(_text(decode, body))
            owners.append(prompt)
            versions.append(None if token_versions is None else
                            torch.tensor([version_number(v) for v in token_versions], dtype=torch.int32))
    # one sample without routes (an aborted request) leaves the others theirs: R3's coverage names it
    has_routes = any(r is not None for r in routes)
    episodes = all(a is not None for a in actions) and bool(actions)
    return Samples(owners, seqs, torch.tensor(plens), logps, routes if has_routes else None, texts,
                   versions=versions if all(v is not None for v in versions) else None,
                   action_masks=actions if episodes else None,
                   env_rewards=torch.tensor(env_rewards, dtype=torch.float32) if episodes else None,
                   turns=torch.tensor(turns, dtype=torch.float32) if episodes else None)


def _text(decode: Any, ids: list[int]) -> str:
    """The completion's text: decoded (an id the tokenizer lacks, e.g. an environment's tool token,
    as `<id N>`), or the ids themselves without a tokenizer."""
    if decode is None:
        return " ".join(map(str, ids))
    try:
        return decode(ids)
    except (ValueError, KeyError, IndexError):
        return "".join(_text(decode, [t]) if len(ids) > 1 else f"<id {t}>" for t in ids)


def version_number(label: str) -> int:
    """The trainer's weight version of an engine's label: our pushes are numbered (the sync's
    version), and the weights a server starts with are version 0 (SGLang labels them "default")."""
    return int(label) if label.isdigit() else 0


def staleness_metrics(run: Any, samples: Samples) -> dict[str, float]:
    """Per token, how many weight versions the weights that generated it are behind the trainer's;
    and the share of samples whose tokens come from more than one version (partial rollouts)."""
    if samples.versions is None or not any(v.numel() for v in samples.versions):
        return {}
    lag = run.weight_version - torch.cat(samples.versions)
    partial = sum(bool(v.numel()) and bool((v != v[0]).any()) for v in samples.versions) / len(samples.versions)
    return {"rollout/staleness_mean": float(lag.float().mean()), "rollout/staleness_max": float(lag.max()),
            "rollout/partial_frac": float(partial)}


# ---------------------------------------------------------------- rewards and advantages

def task_rewards(run: Any, samples: Samples) -> torch.Tensor:
    """`[N]`: the episodes' rewards from their environment (rollout.env), else the reward function's."""
    if samples.env_rewards is not None:
        return samples.env_rewards.clone()
    return torch.tensor(run.rewards.score(samples.prompts, samples.completions, samples.completion_ids()),
                        dtype=torch.float32)


def score(run: Any, samples: Samples) -> dict[str, float]:
    """Task rewards of every sample (rank 0: the reward functions run once, where the samples are)."""
    rewards = samples.rewards = task_rewards(run, samples)
    lengths = torch.tensor(samples.lengths()) - samples.prompt_lens
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
           "reward/min": float(rewards.min()), "reward/max": float(rewards.max()),  # the report's band stays inside
           "reward/success_rate": float((rewards >= 1.0).float().mean()),
           "reward/failures": float(run.rewards.failures),
           "rollout/response_len": float(lengths.float().mean()),
           "rollout/entropy": sampled_entropy(samples)}
    if samples.action_masks is not None:  # multi-turn: how many turns, how much of the context is the environment's
        env_tokens = sum(int((~a).sum()) for a in samples.action_masks)
        out |= {"rollout/turns_mean": float(samples.turns.mean()),
                "rollout/env_token_frac": env_tokens / max(1, int(lengths.sum()))}
    return out


def sampled_entropy(samples: Samples) -> float:
    """Mean -log pi_engine over the sampled response tokens (the model's, not an environment's): an
    unbiased estimate of the sampling policy's per-token entropy, E_a[-log pi(a)] = H(pi), free because
    the engine returns the log-probs. Near 0: the policy samples one answer (the collapse alarm's floor,
    drift.alarm.collapse_entropy). NaN without tokens."""
    masks = samples.action_masks or [None] * len(samples.engine_logp)
    picked = [lp if m is None else lp[m[: lp.shape[0]].bool()] for lp, m in zip(samples.engine_logp, masks)]
    logp = torch.cat([p.float().reshape(-1) for p in picked]) if picked else torch.zeros(0)
    return float(-logp.mean()) if logp.numel() else float("nan")


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
    if a.advantage == "gae":  # per-token advantages come from the critic, after the old pass
        return samples, {}
    samples.advantages = compute_advantages(a.advantage, rewards, group_size=g, eps=a.adv_eps) \
        if a.advantage == "grpo" else compute_advantages(a.advantage, rewards, group_size=g)
    groups = rewards.reshape(-1, g)
    uniform = (groups == groups[:, :1]).all(1).float().mean()  # groups that teach nothing: advantages 0
    return samples, {"adv/abs_mean": float(samples.advantages.abs().mean()), "adv/uniform_groups": float(uniform)}


def usable_groups(kept_groups: int, group_size: int, unit: int) -> int:
    """Most whole groups (<= kept_groups) whose samples split evenly into `unit` shares
    (DP ranks x minibatches); 0 when none do."""
    for k in range(kept_groups, 0, -1):
        if (k * group_size) % unit == 0:
            return k
    return 0


@dataclass
class Share:
    """A DP rank's samples, and its rows of them for each of the step's minibatches."""

    samples: Samples
    minibatches: list[list[int]]


def my_share(run: Any, samples: Samples, step: int, dp_rank: int | None = None) -> Share:
    """DP rank `dp_rank`'s (default: this rank's) share of the samples, minibatch by minibatch
    (`algo.shuffle_minibatches`: taken from the samples in the step's seeded random order)."""
    if run.cfg.algo.shuffle_minibatches:
        key = f"moe_rl.minibatches:{run.cfg.data.shuffle_seed}:{step}"
        samples = samples.select(seeded_shuffle(range(len(samples)), key))
    lengths = samples.lengths()
    mine = share_indices(lengths, run.policy.dp_size, run.policy.dp_rank if dp_rank is None else dp_rank,
                         run.cfg.algo.num_minibatches, by_tokens=run.policy.packs_sequences)
    bounds = list(itertools.accumulate((len(m) for m in mine), initial=0))
    return Share(samples.select([i for m in mine for i in m]),
                 [list(range(a, b)) for a, b in zip(bounds, bounds[1:])])


def share_indices(lengths: list[int], dp: int, rank: int, num_minibatches: int,
                  by_tokens: bool) -> list[list[int]]:
    """Sample indices of `rank`'s part of each minibatch.

    Minibatch k is the same set of samples either way (so the update is the same): the
    k-th slice of every rank's contiguous block. Padded micro-batches need equal counts
    on every rank, so each rank takes its own block's slice; packed micro-batches take
    any count, so the minibatch is spread over ranks by tokens.
    """
    n = len(lengths)
    if n % (dp * num_minibatches):
        raise ValueError(f"{n} samples cannot be split evenly over {dp} data-parallel ranks x "
                         f"{num_minibatches} minibatches; make data.prompts_per_step * rollout.n_samples a "
                         f"multiple of {dp * num_minibatches}")
    per, part = n // dp, n // (dp * num_minibatches)
    out = []
    for k in range(num_minibatches):
        group = [r * per + k * part + j for r in range(dp) for j in range(part)]
        if by_tokens:
            out.append([group[i] for i in balanced_shards([lengths[i] for i in group], dp)[rank]])
        else:
            out.append(group[rank * part: (rank + 1) * part])
    return out


def wait_for_prefetch(run: Any) -> None:
    """Let the rollouts asked for ahead (algo.max_staleness) finish before the engine is used otherwise."""
    if run.async_rollouts is not None:
        run.async_rollouts.drain()


def response_mask(samples: Samples, width: int) -> torch.Tensor:
    """`[B, width]`: 1 where position t predicts a completion token (t >= P - 1, t < T - 1) that
    the model generated: in multi-turn episodes the environment's tokens are context, not actions,
    so they are 0 here and count in no loss, KL, entropy, ratio or normaliser."""
    t = torch.arange(width).view(1, -1)
    lengths = torch.tensor(samples.lengths()).view(-1, 1)
    mask = ((t >= samples.prompt_lens.view(-1, 1) - 1) & (t < lengths - 1)).float()
    if samples.action_masks is not None:
        for i, (p, action) in enumerate(zip(samples.prompt_lens.tolist(), samples.action_masks)):
            row = mask[i, p - 1: p - 1 + action.numel()]  # position p-1+j predicts completion token j
            row *= action[: row.numel()].float()
    return mask


def replay_coverage(run: Any, samples: Samples) -> dict[str, float]:
    """Rank 0, under R3: the share of the step's tokens that replay an engine route (replay/coverage*),
    failing below algo.replay_min_coverage before any rank trains (moe_rl/recipes/rl/replay_health.py)."""
    if replay_mode(run.cfg.algo) != "r3":
        return {}
    arch, width = run.policy.arch, max(samples.lengths()) - 1
    return coverage(samples, response_mask(samples, width).bool(), list(arch.moe_layers), arch.num_moe_experts,
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
    metrics |= score(run, samples) | {"rollout/staleness": float(staleness)} | staleness_metrics(run, samples)
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


def evaluate(run: Any, dataset: PromptDataset, step: int) -> dict[str, float]:
    """Greedy success rate on a held-out prompt set (rank 0 generates and scores, every rank gets it)."""
    def on_rank0() -> dict[str, float]:
        samples = generate(run, list(dataset), step, greedy=True)
        rewards = task_rewards(run, samples)
        return {"eval/success_rate": float((rewards >= 1.0).float().mean()),
                "eval/reward_mean": float(rewards.mean())}
    return unwrap(broadcast_object(attempt(on_rank0) if run.rank == 0 else None))
