"""Group advantages (GRPO, Dr.GRPO, RLOO) against loops, and their edge cases."""
from __future__ import annotations

import statistics

import pytest
import torch

from moe_rl.algo import broadcast_to_tokens, compute_advantages, grpo_advantages, rloo_advantages

DT = torch.float64


def groups_of(rewards, g):
    return [rewards[i:i + g] for i in range(0, len(rewards), g)]


def ref(name, rewards, g, eps=1e-6):
    out = []
    for grp in groups_of(rewards, g):
        mean = sum(grp) / len(grp)
        for j, r in enumerate(grp):
            if name == "grpo":
                std = statistics.stdev(grp) if len(grp) > 1 else 0.0
                out.append((r - mean) / (std + eps))
            elif name == "drgrpo":
                out.append(r - mean)
            else:
                others = grp[:j] + grp[j + 1:]
                out.append(r - sum(others) / len(others) if others else 0.0)
    return out


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_consecutive_groups_match_loops(name, g):
    rewards = torch.rand(16, generator=torch.Generator().manual_seed(g), dtype=DT).round(decimals=1)
    got = compute_advantages(name, rewards, group_size=g)
    assert got.tolist() == pytest.approx(ref(name, rewards.tolist(), g), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_index_any_order_and_size(name):
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25], dtype=DT)
    index = torch.tensor([7, 3, 7, 3, 42, 7, 3, 7])  # groups {7: 4 samples, 3: 3, 42: 1}
    got = compute_advantages(name, rewards, group_index=index)
    order = torch.argsort(index, stable=True)
    sizes = [3, 4, 1]  # groups 3, 7, 42 in sorted order
    expected_sorted, start = [], 0
    for n in sizes:
        expected_sorted += ref(name, rewards[order][start:start + n].tolist(), n)
        start += n
    assert got[order].tolist() == pytest.approx(expected_sorted, rel=1e-12, abs=1e-12)


def test_singletons_and_equal_rewards_give_zero_advantage():
    for name in ["grpo", "drgrpo", "rloo"]:
        assert compute_advantages(name, torch.tensor([3.0, -1.0, 0.5]), group_size=1).tolist() == [0.0] * 3
        assert compute_advantages(name, torch.tensor([1.0] * 4 + [0.0] * 4), group_size=4).tolist() == [0.0] * 8
    # eps = 0 and zero std: 0, not nan
    assert grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), group_size=2, eps=0.0).tolist() == \
        pytest.approx([0.0, 0.0, -0.7071067811865476, 0.7071067811865476])


def test_grpo_biased_std_option_and_rloo_identity():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=DT)
    assert grpo_advantages(r, group_size=4, eps=0.0, unbiased=False)[0].item() == pytest.approx(0.75 / 0.4330127018922193)
    # RLOO = G/(G−1) · Dr.GRPO
    torch.testing.assert_close(rloo_advantages(r, group_size=4), compute_advantages("drgrpo", r, group_size=4) * 4 / 3)


def test_integer_rewards_and_per_token_broadcast():
    rewards = torch.tensor([1, 0, 0, 0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = compute_advantages("drgrpo", rewards, group_size=2, mask=mask)
    assert adv.shape == (4, 3) and adv.dtype == torch.float32
    assert adv.tolist() == [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert (broadcast_to_tokens(torch.tensor([2.0, 3.0]), mask[:2]) == torch.tensor([[2.0, 2, 0], [3, 0, 0]])).all()


@pytest.mark.parametrize("kw,text", [
    ({}, "group_size / group_index must be exactly one given"),
    ({"group_size": 2, "group_index": torch.zeros(6, dtype=torch.long)}, "exactly one given"),
    ({"group_size": 4}, "group_ids: group_size must be a divisor of the batch size 6, got 4"),
    ({"group_size": 0}, "group_ids: group_size must be >= 1, got 0"),
    ({"group_index": torch.zeros(6)}, "group_index.dtype must be an integer type, got torch.float32"),
    ({"group_index": torch.zeros(5, dtype=torch.long)}, "group_index.shape must be (6,), got (5,)"),
    ({"group_size": 2, "eps": -1e-6}, "grpo_advantages: eps must be >= 0, got -1e-06"),
])
def test_bad_arguments(kw, text):
    with pytest.raises(ValueError) as info:
        compute_advantages("grpo", torch.zeros(6), **kw)
    assert text in str(info.value)


def test_unknown_estimator_and_parameter():
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'; choose one of drgrpo, grpo, rloo"):
        compute_advantages("gae", torch.zeros(4), group_size=2)
    with pytest.raises(ValueError, match="unknown parameter\\(s\\) 'eps' for 'rloo'; accepted: none"):
        compute_advantages("rloo", torch.zeros(4), group_size=2, eps=1e-6)
