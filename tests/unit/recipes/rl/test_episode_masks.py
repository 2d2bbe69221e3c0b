"""Multi-turn episodes: the environment's tokens are context, not actions. Every objective's loss
and gradient over an episode equal those over the same samples with the environment's tokens cut
out (the reference: what the objective would see if only the model's tokens existed), with the
KL penalty and truncated IS on, and no gradient reaches an environment token."""
from __future__ import annotations

import pytest
import torch

from moe_rl.algo import LOSSES, compute_loss
from moe_rl.data.dataset import Prompt
from moe_rl.samples import response_mask
from moe_rl.samples import Samples

DT = torch.float64
# (prompt length, completion action mask): model turns with environment answers in between
EPISODES = [(3, [1, 1, 0, 0, 1, 1]), (2, [1, 0, 1]), (4, [1, 1, 1, 1]), (3, [1, 0, 0, 0, 1, 1, 1]),
            (2, [1, 1, 0, 1])]


def _samples(episodes) -> Samples:
    prompts = [Prompt(f"p{i}", [1] * p, "", None) for i, (p, _) in enumerate(episodes)]
    seqs = [torch.arange(p + len(a)) for p, a in episodes]
    return Samples(prompts, seqs, torch.tensor([p for p, _ in episodes]), [torch.zeros(len(a)) for _, a in episodes],
                   None, [""] * len(episodes),
                   action_masks=[torch.tensor(a, dtype=torch.bool) for _, a in episodes])


def _compact(x: torch.Tensor, keep: torch.Tensor, width: int) -> torch.Tensor:
    """Row i's kept positions, left-aligned at its prompt's last position, zero-padded."""
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    for i, (p, _) in enumerate(EPISODES):
        vals = x[i][keep[i]]
        out[i, p - 1: p - 1 + vals.numel()] = vals
    return out


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_an_episodes_loss_is_the_loss_of_its_model_tokens_alone(name):
    width = max(p + len(a) for p, a in EPISODES) - 1
    mask = response_mask(_samples(EPISODES), width)
    # the environment's tokens are 0 in the mask; the response positions are still the whole completion
    for i, (p, a) in enumerate(EPISODES):
        assert mask[i, p - 1: p - 1 + len(a)].tolist() == [float(x) for x in a]
        assert mask[i].sum() == sum(a)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(len(EPISODES), width, generator=g, dtype=DT) * 2
    logp = (old + 0.3 * torch.randn(old.shape, generator=g, dtype=DT)).requires_grad_()
    rollout = old + 0.2 * torch.randn(old.shape, generator=g, dtype=DT)
    ref = old + 0.1 * torch.randn(old.shape, generator=g, dtype=DT)
    adv = torch.randn(len(EPISODES), generator=g, dtype=DT)
    kw = dict(rollout_logp=rollout, tis_cap=2.0, ref_logp=ref, beta=0.1, max_len=width)
    loss, metrics = compute_loss(name, logp=logp, old_logp=old, advantages=adv, mask=mask, **kw)
    loss.backward()

    cut = [(p, [1] * sum(a)) for p, a in EPISODES]
    keep = mask.bool()
    short = response_mask(_samples(cut), width)
    c_logp = _compact(logp.detach(), keep, width).requires_grad_()
    c_loss, c_metrics = compute_loss(name, logp=c_logp, old_logp=_compact(old, keep, width), advantages=adv,
                                     mask=short, **{**kw, "rollout_logp": _compact(rollout, keep, width),
                                                    "ref_logp": _compact(ref, keep, width)})
    c_loss.backward()
    assert loss.item() == pytest.approx(c_loss.item(), rel=1e-12, abs=1e-12)
    assert metrics["loss/num_tokens"] == c_metrics["loss/num_tokens"] == sum(sum(a) for _, a in EPISODES)
    assert torch.equal(logp.grad[~keep], torch.zeros_like(logp.grad[~keep]))  # no gradient at the environment's
    torch.testing.assert_close(logp.grad[keep], c_logp.grad[short.bool()], rtol=1e-10, atol=1e-12)


def test_single_turn_samples_keep_the_whole_completion():
    s = _samples(EPISODES)
    s.action_masks = None
    width = max(p + len(a) for p, a in EPISODES) - 1
    assert response_mask(s, width).sum() == sum(len(a) for _, a in EPISODES)


def test_position_turns_give_each_token_its_episode_turn():
    from moe_rl.recipes.rl.drift_views import position_turns

    # prompt 3, then: env opening [F], turn 0 [T, T], answer [F, F], turn 1 [T], answer [F], turn 2 [T, T]
    s = _samples([(3, [0, 1, 1, 0, 0, 1, 0, 1, 1])])
    turns = position_turns(s, 14)[0].tolist()
    assert turns == [0, 0, 0] + [0, 0, 0, 0, 0, 1, 1, 2, 2] + [-1, -1]
    assert position_turns(s, 6)[0].tolist() == [0, 0, 0, 0, 0, 0]  # cut at the width


@pytest.mark.parametrize("lam", [0.95, 1.0, "adaptive"])
def test_gae_over_an_episode_is_gae_over_its_model_tokens_alone(lam):
    """Values at the model's tokens only: the environment's are skipped, the next model token's value
    and the running sum carried across them, so the advantages and returns at the model's tokens are
    those of the same samples with the environment's tokens cut out."""
    from moe_rl.algo.advantages import compute_gae, length_adaptive_lambda, token_rewards

    width = max(p + len(a) for p, a in EPISODES) - 1
    mask = response_mask(_samples(EPISODES), width)
    keep = mask.bool()
    short = response_mask(_samples([(p, [1] * sum(a)) for p, a in EPISODES]), width)
    g = torch.Generator().manual_seed(1)
    values = torch.randn(len(EPISODES), width, generator=g, dtype=DT)
    rewards = torch.randn(len(EPISODES), generator=g, dtype=DT)

    def gae(m, v):
        lam_ = length_adaptive_lambda(m.sum(1), 0.5) if lam == "adaptive" else lam
        return compute_gae(token_rewards(rewards, m), v, m, gamma=0.99, lam=lam_)

    adv, ret = gae(mask, values)
    c_adv, c_ret = gae(short, _compact(values, keep, width))
    torch.testing.assert_close(adv[keep], c_adv[short.bool()], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret[keep], c_ret[short.bool()], rtol=1e-12, atol=1e-12)
    assert torch.equal(adv[~keep], torch.zeros_like(adv[~keep]))
