"""GAE, token rewards, length-adaptive λ and whitening against plain loops written here."""
from __future__ import annotations

import pytest
import torch

from moe_rl.algo.advantages import compute_gae, length_adaptive_lambda, token_rewards, whiten

DT = torch.float64


def loop_gae(rewards, values, mask, gamma, lams):
    """Textbook GAE per row over the masked steps only (a Python list per row)."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        steps = [t for t in range(T) if mask[b][t]]
        lam = lams[b] if isinstance(lams, list) else lams
        running = 0.0
        for j in reversed(range(len(steps))):
            t = steps[j]
            nxt = values[b][steps[j + 1]] if j + 1 < len(steps) else 0.0
            delta = rewards[b][t] + gamma * nxt - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    ret = [[adv[b][t] + values[b][t] if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return adv, ret


def batch(seed=0, B=5, T=9):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, dtype=DT)
    prompt = torch.randint(0, 3, (B,), generator=g)
    length = torch.randint(1, T - 2, (B,), generator=g)
    t = torch.arange(T)
    mask = ((t >= prompt[:, None]) & (t < (prompt + length)[:, None])).to(DT)  # prompt prefix + padding
    seq_reward = torch.randn(B, generator=g, dtype=DT)
    rewards = token_rewards(seq_reward, mask) + 0.1 * torch.randn(B, T, generator=g, dtype=DT) * mask
    return rewards.to(DT), values, mask


def check(rewards, values, mask, gamma, lam):
    adv, ret = compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
    lams = lam.tolist() if isinstance(lam, torch.Tensor) else lam
    ref_adv, ref_ret = loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lams)
    assert torch.allclose(adv, torch.tensor(ref_adv, dtype=DT), atol=1e-12)
    assert torch.allclose(ret, torch.tensor(ref_ret, dtype=DT), atol=1e-12)
    return adv, ret


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
def test_gae_matches_loop_with_prompt_prefix_and_padding(gamma, lam):
    rewards, values, mask = batch(seed=int(lam * 100) + int(gamma * 10))
    adv, ret = check(rewards, values, mask, gamma, lam)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_lambda_one_gamma_one_is_reward_to_go_minus_value():
    rewards, values, mask = batch(seed=3)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = rewards.flip(1).cumsum(1).flip(1)  # rewards are 0 outside the mask
    assert torch.allclose(adv, (to_go - values) * mask, atol=1e-12)
    assert torch.allclose(ret, to_go * mask, atol=1e-12)


def test_lambda_zero_is_one_step_td_error():
    rewards, values, mask = batch(seed=4)
    adv, _ = compute_gae(rewards, values, mask, gamma=0.9, lam=0.0)
    nxt = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(values.shape[0], 1, dtype=DT)], 1)
    assert torch.allclose(adv, (rewards + 0.9 * nxt - values) * mask, atol=1e-12)


def test_per_sequence_lambda():
    rewards, values, mask = batch(seed=5)
    lam = torch.tensor([0.0, 0.3, 0.95, 1.0, 0.7], dtype=DT)
    adv, _ = check(rewards, values, mask, 1.0, lam)
    for b in range(5):  # each row equals a run with its own scalar λ
        single, _ = compute_gae(rewards[b:b + 1], values[b:b + 1], mask[b:b + 1], lam=float(lam[b]))
        assert torch.equal(adv[b], single[0])


def test_holes_in_the_mask_are_skipped():
    rewards, values, mask = batch(seed=6, B=3, T=10)
    mask[:, :] = 0
    mask[:, [1, 2, 5, 8]] = 1  # steps 1, 2, 5, 8 of one episode
    check(rewards, values, mask, 0.95, 0.9)


def test_token_rewards_on_last_step_plus_per_token_terms():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=DT)
    got = token_rewards(torch.tensor([2.0, -1.0, 5.0], dtype=DT), mask)
    assert got.tolist() == [[0, 0, 0, 2, 0], [0, -1, 0, 0, 0], [0, 0, 0, 0, 0]]
    kl = torch.full((3, 5), 0.5, dtype=DT)
    with_kl = token_rewards(torch.tensor([2.0, -1.0, 5.0], dtype=DT), mask, per_token=-kl)
    assert torch.equal(with_kl, got - 0.5 * mask)


def test_length_adaptive_lambda():
    lengths = torch.tensor([1, 10, 20, 21, 100, 1000])
    lam = length_adaptive_lambda(lengths, alpha=0.05)
    ref = [0.0 if 0.05 * n <= 1 else 1 - 1 / (0.05 * n) for n in lengths.tolist()]
    assert lam.tolist() == pytest.approx(ref, abs=1e-7)
    assert (lam >= 0).all() and (lam < 1).all()
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(lengths, alpha=0.0)


def test_bad_lambda_and_shapes_are_refused():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(r, r, r, lam=1.5)
    with pytest.raises(ValueError, match="lam.shape"):
        compute_gae(r, r, r, lam=torch.ones(3))
    with pytest.raises(ValueError, match="shapes"):
        compute_gae(r, torch.zeros(2, 4), r)


def test_whiten_pieces_use_the_whole_batch_statistics():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, generator=g, dtype=DT)
    mask = (torch.rand(6, 5, generator=g) > 0.3).to(DT)
    whole = whiten(x, mask)
    sel = x[mask.bool()]
    assert torch.allclose(whole[mask.bool()], (sel - sel.mean()) / (sel.std(unbiased=False) + 1e-8), atol=1e-12)
    assert (whole[mask == 0] == 0).all()
    pieces = [(x[:2], mask[:2]), (x[2:], mask[2:])]

    def total(stats):
        return sum(torch.stack([m.sum().to(DT), (p * m).sum(), (p * p * m).sum()]) for p, m in pieces)

    got = torch.cat([whiten(p, m, sums=total) for p, m in pieces])
    assert torch.allclose(got, whole, atol=1e-12)
