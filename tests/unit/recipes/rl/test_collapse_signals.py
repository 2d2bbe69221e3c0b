"""The step metrics the collapse alarm reads: the sampled tokens' entropy estimate and the uniform groups."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from moe_rl.samples import Samples

from moe_rl.recipes.rl.batch import advantages_and_filters, entropy_of, sample_stats


def _samples(logps: list[torch.Tensor], masks: list[torch.Tensor] | None = None) -> Samples:
    seqs = [torch.zeros(2 + len(lp), dtype=torch.long) for lp in logps]
    return Samples(prompts=[None] * len(logps), sequences=seqs, prompt_lens=torch.full((len(logps),), 2),
                   engine_logp=logps, routes=None, completions=[""] * len(logps), action_masks=masks)


def sampled_entropy(samples: Samples) -> float:
    return entropy_of(sample_stats(samples))


def test_sampled_entropy_estimates_the_sampling_distributions_entropy():
    """Tokens drawn from a known categorical: the mean -log p of the draws against its entropy."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.7, 0.2, 0.05, 0.05])
    exact = float(-(probs * probs.log()).sum())
    draws = torch.multinomial(probs, 40_000, replacement=True, generator=g)
    logps = list(probs.log()[draws].reshape(400, 100))  # 400 samples of 100 tokens
    assert math.isclose(sampled_entropy(_samples(logps)), exact, abs_tol=0.01)  # ~4 standard errors


def test_sampled_entropy_counts_the_models_tokens_only_and_is_nan_without_any():
    logps = [torch.tensor([-1.0, -5.0, -3.0])]
    masks = [torch.tensor([True, False, True])]  # the environment's token (-5) is not the policy's draw
    assert sampled_entropy(_samples(logps, masks)) == 2.0
    assert math.isnan(sampled_entropy(_samples([torch.zeros(0)])))


def test_uniform_groups_is_the_share_of_groups_whose_rewards_all_agree():
    samples = _samples([torch.zeros(1)] * 6)
    samples.rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups of 2: agree, differ, agree
    algo = SimpleNamespace(overlong_max_len=None, advantage="grpo", adv_eps=1e-6)
    run = SimpleNamespace(cfg=SimpleNamespace(algo=algo, rollout=SimpleNamespace(n_samples=2)))
    _, metrics = advantages_and_filters(run, samples)
    assert math.isclose(metrics["adv/uniform_groups"], 2 / 3, rel_tol=1e-6)
