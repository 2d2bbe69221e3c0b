"""PromptSampler: seeded order, DP sharding, epochs and exact resume."""
from __future__ import annotations

import itertools

import pytest

from moe_rl.data import PromptSampler


def take(sampler, n):
    return list(itertools.islice(sampler, n))


def test_same_seed_same_order_other_seed_other_order():
    assert take(PromptSampler(50, 8, seed=3), 12) == take(PromptSampler(50, 8, seed=3), 12)
    assert take(PromptSampler(50, 8, seed=3), 12) != take(PromptSampler(50, 8, seed=4), 12)


def test_epochs_reshuffle_and_cover():
    s = PromptSampler(24, 8, seed=0)
    epochs = [sum(take(s, 3), []) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(24))  # each epoch visits every prompt once
    assert epochs[0] != epochs[1] != epochs[2]


def test_remainder_is_left_out_and_batches_stay_distinct():
    s = PromptSampler(9, 4, seed=1)
    assert s.steps_per_epoch == 2
    for batch in take(s, 20):
        assert len(set(batch)) == 4


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_dp_shards_are_disjoint_and_cover_the_global_batch(dp_size):
    ranks = [PromptSampler(40, 8, seed=5, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    reference = PromptSampler(40, 8, seed=5)
    for _ in range(12):
        shards = [next(s) for s in ranks]
        assert all(len(sh) == 8 // dp_size for sh in shards)
        assert sum(shards, []) == next(reference)  # disjoint slices of the same global batch


def test_resume_gives_identical_next_batches():
    run = PromptSampler(30, 6, seed=7, dp_rank=1, dp_size=2)
    take(run, 7)  # crosses an epoch boundary (5 steps per epoch)
    state = run.state_dict()
    expected = take(run, 9)
    resumed = PromptSampler(30, 6, seed=7, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert take(resumed, 9) == expected


def test_resume_with_other_dp_size_keeps_the_global_order():
    run = PromptSampler(30, 6, seed=7)
    take(run, 3)
    state = run.state_dict()
    expected = next(run)
    halves = [PromptSampler(30, 6, seed=7, dp_rank=r, dp_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    assert next(halves[0]) + next(halves[1]) == expected


def test_resume_refuses_another_data_order():
    state = PromptSampler(30, 6, seed=7).state_dict()
    with pytest.raises(ValueError, match="seed=7 but this run has seed=8"):
        PromptSampler(30, 6, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len=30"):
        PromptSampler(31, 6, seed=7).load_state_dict(state)


@pytest.mark.parametrize("kwargs,expected", [
    (dict(dataset_len=10, batch_size=6, dp_size=4), "multiple of the data-parallel size 4"),
    (dict(dataset_len=5, batch_size=8), "5 prompts, fewer than"),
    (dict(dataset_len=10, batch_size=4, dp_rank=2, dp_size=2), "dp_rank=2"),
])
def test_bad_sizes(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        PromptSampler(**kwargs)


def test_no_shuffle_is_sequential():
    assert take(PromptSampler(6, 3, shuffle=False), 3) == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
