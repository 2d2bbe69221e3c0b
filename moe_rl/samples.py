"""The step's rows: `Samples` (the samples of one step, prompt-major) and their split over data-parallel
ranks and minibatches (`Share`, `split`), shared by every recipe (RL and DPO plan their shares alike),
and the per-position views the losses read of them (`response_mask`, `engine_logp_tokens`).

Nothing here talks to an engine or a model: it is the data every stage of a step passes on.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from moe_rl.data.balance import balanced_shards
from moe_rl.data.dataset import Prompt
from moe_rl.data.sampler import seeded_shuffle


# ---------------------------------------------------------------- the rows

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


def engine_logp_tokens(samples: Samples, width: int) -> torch.Tensor:
    """Engine log-probs placed at the positions that predict them: `[B, width]`."""
    out = torch.zeros(len(samples), width)
    for i, (p, lp) in enumerate(zip(samples.prompt_lens.tolist(), samples.engine_logp)):
        out[i, p - 1: p - 1 + lp.shape[0]] = lp[: max(width - p + 1, 0)]
    return out


# ---------------------------------------------------------------- their split over DP ranks and minibatches

@dataclass
class Share:
    """A DP rank's samples, and its rows of them for each of the step's minibatches."""

    samples: Samples
    minibatches: list[list[int]]


def split(samples: Samples, dp: int, rank: int, num_minibatches: int, by_tokens: bool,
          order_key: str | None = None) -> Share:
    """DP rank `rank`'s share of the samples, minibatch by minibatch (`share_plan`)."""
    return share_of(samples, share_plan(samples.lengths(), dp, rank, num_minibatches, by_tokens, order_key))


def share_plan(lengths: list[int], dp: int, rank: int, num_minibatches: int, by_tokens: bool,
               order_key: str | None = None) -> list[list[int]]:
    """Indices (into `lengths`' order) of `rank`'s part of each minibatch (`share_indices`); `order_key`:
    taken from the samples in that key's seeded random order (the same on every rank)."""
    order = seeded_shuffle(range(len(lengths)), order_key) if order_key is not None else list(range(len(lengths)))
    mine = share_indices([lengths[i] for i in order], dp, rank, num_minibatches, by_tokens=by_tokens)
    return [[order[i] for i in m] for m in mine]


def share_of(samples: Samples, minibatches: list[list[int]]) -> Share:
    """The `Share` of a plan: its samples, minibatch after minibatch, and each minibatch's rows of them."""
    bounds = list(itertools.accumulate((len(m) for m in minibatches), initial=0))
    return Share(samples.select([i for m in minibatches for i in m]),
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


def usable_groups(kept_groups: int, group_size: int, unit: int) -> int:
    """Most whole groups (<= kept_groups) whose samples split evenly into `unit` shares
    (DP ranks x minibatches); 0 when none do."""
    for k in range(kept_groups, 0, -1):
        if (k * group_size) % unit == 0:
            return k
    return 0
