"""DAPO dynamic sampling and overlong reward shaping."""
from __future__ import annotations

import pytest
import torch

from moe_rl.algo import dynamic_sampling, overlong_penalty, shape_overlong_rewards


def test_keeps_only_groups_with_mixed_rewards():
    # groups of 4: all wrong, mixed, all correct, mixed
    rewards = torch.tensor([0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.float32)
    res = dynamic_sampling(rewards, group_size=4)
    assert res.keep.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert (res.num_groups, res.num_kept_groups, res.num_dropped_groups, res.all_dropped) == (4, 2, 2, False)
    assert "kept 2 of 4 groups (8 samples), dropped 2" in res.message
    assert res.metrics() == {"filter/num_groups": 4.0, "filter/kept_groups": 2.0, "filter/dropped_groups": 2.0,
                             "filter/kept_samples": 8.0}


def test_all_groups_dropped_is_reported_not_raised():
    res = dynamic_sampling(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5]), group_size=2)
    assert res.all_dropped and res.keep.numel() == 0 and res.keep.dtype == torch.long
    assert res.num_kept_groups == 0 and res.num_dropped_groups == 3
    assert "all 3 groups dropped" in res.message and "skip this step" in res.message


def test_group_index_singletons_and_tolerance():
    rewards = torch.tensor([0.5, 0.9, 0.5, 0.7, 0.5000001])
    index = torch.tensor([2, 0, 2, 1, 2])  # group 0 and 1 are singletons
    res = dynamic_sampling(rewards, group_index=index)
    assert res.keep.tolist() == [0, 2, 4] and res.num_dropped_groups == 2
    assert dynamic_sampling(rewards, group_index=index, tol=1e-3).all_dropped
    assert dynamic_sampling(torch.tensor([1.0, 0.0]), group_size=1).all_dropped


def test_empty_batch_and_bad_arguments():
    res = dynamic_sampling(torch.zeros(0), group_size=4)
    assert res.all_dropped and res.num_groups == 0 and "empty batch" in res.message
    with pytest.raises(ValueError, match="dynamic_sampling: tol must be >= 0, got -1"):
        dynamic_sampling(torch.zeros(4), group_size=2, tol=-1)


def test_overlong_penalty_piecewise():
    lengths = torch.tensor([0, 12, 13, 14, 15, 16, 17, 100])
    got = overlong_penalty(lengths, max_len=16, cache_len=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    assert overlong_penalty(lengths, max_len=16, cache_len=0).tolist() == [0.0] * 6 + [-1.0] * 2
    assert overlong_penalty(lengths, max_len=16, cache_len=16).tolist() == pytest.approx(
        [0.0, -0.75, -13 / 16, -14 / 16, -15 / 16, -1.0, -1.0, -1.0])


def test_shape_overlong_rewards():
    rewards = torch.tensor([1, 0, 1])
    shaped = shape_overlong_rewards(rewards, torch.tensor([10, 14, 20]), max_len=16, cache_len=4, factor=0.5)
    assert shaped.tolist() == pytest.approx([1.0, -0.25, 0.5])


@pytest.mark.parametrize("kw,text", [
    ({"max_len": 0, "cache_len": 0}, "overlong_penalty: max_len must be > 0, got 0"),
    ({"max_len": 8, "cache_len": 9}, "overlong_penalty: cache_len must be in [0, max_len=8], got 9"),
    ({"max_len": 8, "cache_len": -1}, "cache_len must be in [0, max_len=8], got -1"),
])
def test_overlong_bad_arguments(kw, text):
    with pytest.raises(ValueError) as info:
        overlong_penalty(torch.tensor([1]), **kw)
    assert text in str(info.value)
