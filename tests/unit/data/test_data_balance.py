"""Token-budget bins and token-balanced shards."""
from __future__ import annotations

import random

import pytest

from moe_rl.data.balance import balanced_shards, pack_bins


def _check_partition(groups, n):
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(n)), "every index exactly once"
    for g in groups:
        assert g == sorted(g), "original order kept inside a group"


@pytest.mark.parametrize("seed", range(5))
def test_pack_bins_respects_budget_and_is_near_minimal(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(16, 1024) for _ in range(64)]
    bins = pack_bins(lengths, 2048)
    _check_partition(bins, len(lengths))
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    lower_bound = -(-sum(lengths) // 2048)
    assert len(bins) <= lower_bound + 2  # first-fit decreasing is close to optimal on such spreads


def test_pack_bins_exact_fit_and_one_per_bin():
    assert sorted(pack_bins([5, 5, 5, 5], 10)) == [[0, 2], [1, 3]]
    assert pack_bins([7, 7, 7], 10) == [[0], [1], [2]]
    assert pack_bins([], 10) == []


@pytest.mark.parametrize("seed", range(5))
def test_pack_bins_fills_evenly(seed):
    """As many bins as first-fit decreasing needs, with fills within one sequence of each other."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 1024) for _ in range(64)]
    fills = [sum(lengths[i] for i in b) for b in pack_bins(lengths, 4096)]
    assert max(fills) - min(fills) <= max(lengths)


def test_pack_bins_falls_back_when_even_fills_overflow():
    lengths = [4, 5, 3, 4, 3, 1, 10]  # spread evenly over 3 bins, one would hold 11 tokens
    bins = pack_bins(lengths, 10)
    assert len(bins) == 3 and all(sum(lengths[i] for i in b) <= 10 for b in bins)


def test_pack_bins_names_the_sequence_that_cannot_fit():
    with pytest.raises(ValueError, match=r"sequence 1 has 12 tokens.*max_tokens_per_microbatch to at least 12"):
        pack_bins([3, 12, 4], 10)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        pack_bins([3], 0)


@pytest.mark.parametrize("seed", range(5))
def test_balanced_shards_beat_contiguous_split(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(16, 1024) for _ in range(32)]
    shards = balanced_shards(lengths, 4)
    _check_partition(shards, len(lengths))
    totals = [sum(lengths[i] for i in s) for s in shards]
    contiguous = [sum(lengths[k * 8:(k + 1) * 8]) for k in range(4)]
    assert max(totals) - min(totals) <= max(lengths)  # LPT bound
    assert max(totals) <= max(contiguous)
    assert all(shards), "every shard gets a sequence"


def test_balanced_shards_small_cases():
    assert balanced_shards([10, 1, 1, 8], 2) == [[0], [1, 2, 3]]
    assert balanced_shards([3, 3], 2) == [[0], [1]]
    assert balanced_shards([], 3) == [[], [], []]
