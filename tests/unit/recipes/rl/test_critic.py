"""The critic's stage of a step (moe_rl/recipes/rl/critic.py) with a stand-in critic: which λ feeds
which GAE, what the value updates receive, warm-up flag and metrics."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_rl.algo.advantages import compute_gae, length_adaptive_lambda, token_rewards
from moe_rl.config import load_config
from moe_rl.samples import response_mask
from moe_rl.samples import Samples, Share
from moe_rl.recipes.rl.critic import critic_step
from moe_rl.recipes.rl.old_pass import OldPass


class StandInCritic:
    """Values from a fixed table; `update` records what the value loss would see."""

    dp_group = None
    reports_loss = True
    arch = SimpleNamespace(moe_layers=(0, 1))

    def __init__(self, values):
        self.table, self.updates = values, []

    def values(self, sequences, record_routes=False, replay_routes=None):
        return self.table.clone(), None

    def update(self, sequences, extras, loss, replay_routes=None):
        self.updates.append({k: v.clone() for k, v in extras.items()})
        return SimpleNamespace(microbatches=[], step={"perf/grad_norm": 0.5, "perf/lr": 1e-3})

    def all_reduce_sum(self, t, group="dp"):
        return t

    all_reduce_max = all_reduce_sum


def _setup(overrides, step=1):
    cfg = load_config(None, ["algo.advantage=gae", "algo.num_minibatches=2", "rollout.n_samples=2",
                             "data.prompts_per_step=2", "drift.enabled=false", *overrides])
    plens = torch.tensor([2, 3, 2, 2])
    seqs = [torch.arange(n) for n in (6, 7, 4, 5)]  # responses of 4, 4, 2, 3 tokens
    samples = Samples([None] * 4, seqs, plens, [torch.zeros(int(len(s) - p)) for s, p in zip(seqs, plens)],
                      None, [""] * 4, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    width = max(len(s) for s in seqs) - 1
    values = torch.linspace(-0.5, 0.7, 4 * width).view(4, width)
    critic = StandInCritic(values)
    policy = SimpleNamespace(all_reduce_sum=lambda t, group="dp": t)
    run = SimpleNamespace(cfg=cfg, critic=critic, policy=policy, drift_state={}, rank=0)
    share = Share(samples, [[0, 1], [2, 3]])
    old = OldPass(torch.zeros(4, width), None, None, None)
    metrics = critic_step(run, share, old, step)
    mask = response_mask(samples, width)
    return metrics, samples, critic, values * mask, mask


def test_decoupled_lambdas_policy_and_value_targets():
    metrics, samples, critic, values, mask = _setup(["algo.lam=0.5", "critic.lam=1.0", "critic.updates_per_step=2"])
    rewards = token_rewards(samples.rewards, mask)
    adv_05, ret_05 = compute_gae(rewards, values, mask, lam=0.5)
    _, ret_1 = compute_gae(rewards, values, mask, lam=1.0)
    assert torch.allclose(samples.advantages, adv_05)
    assert not torch.allclose(ret_05, ret_1)  # the two λs give different targets here
    assert len(critic.updates) == 4  # 2 passes x 2 minibatches
    for k, idx in enumerate([[0, 1], [2, 3]] * 2):
        assert torch.allclose(critic.updates[k]["returns"], ret_1[idx])  # targets use critic.lam
        assert torch.allclose(critic.updates[k]["old_values"] * mask[idx], values[idx])
    assert metrics["critic/lam_policy_mean"] == pytest.approx(0.5)
    assert metrics["critic/warmup"] == 0.0 and metrics["critic/grad_norm"] == 0.5
    m = mask.bool()
    err, ret = (ret_1 - values)[m], ret_1[m]
    assert metrics["critic/explained_variance"] == pytest.approx(
        float(1 - err.var(unbiased=False) / ret.var(unbiased=False)), rel=1e-5)
    assert metrics["critic/return_mean"] == pytest.approx(float(ret.mean()), rel=1e-5)


def test_adaptive_lambda_and_whitening():
    metrics, samples, _, values, mask = _setup(["algo.lam=adaptive", "algo.lam_alpha=0.5",
                                                "algo.whiten_advantages=true"])
    lam = length_adaptive_lambda(mask.sum(1), 0.5)  # lengths 4, 4, 2, 3 -> 0.5, 0.5, 0, 1/3
    assert lam.tolist() == pytest.approx([0.5, 0.5, 0.0, 1 / 3])
    adv, _ = compute_gae(token_rewards(samples.rewards, mask), values, mask, lam=lam)
    a = adv[mask.bool()]
    assert torch.allclose(samples.advantages[mask.bool()], (a - a.mean()) / (a.std(unbiased=False) + 1e-8), atol=1e-5)
    assert metrics["critic/lam_policy_mean"] == pytest.approx(float(lam.mean()))


def test_warmup_steps_flag_the_policy_off():
    assert _setup(["critic.warmup_steps=2", "train.steps=5"], step=2)[0]["critic/warmup"] == 1.0
    assert _setup(["critic.warmup_steps=2", "train.steps=5"], step=3)[0]["critic/warmup"] == 0.0


def test_critic_config_errors():
    from moe_rl.config import ConfigError

    with pytest.raises(ConfigError, match="algo.lam: 'fast' must be a number in \\[0, 1\\] or 'adaptive'"):
        load_config(None, ["algo.lam=fast"])
    with pytest.raises(ConfigError, match="critic.warmup_steps: 20 must be < train.steps=20"):
        load_config(None, ["algo.advantage=gae", "critic.warmup_steps=20"])
    with pytest.raises(ConfigError, match="critic.replay: 'r3' is not one of off, r2"):
        load_config(None, ["critic.replay=r3"])
