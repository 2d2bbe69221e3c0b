"""Pure helpers of the RL loop."""
from __future__ import annotations

import pytest

from moe_rl.loop import usable_groups


@pytest.mark.parametrize("kept,g,unit,expected", [
    (5, 16, 4, 5),   # every group fits
    (3, 6, 4, 2),    # 18 samples do not split into 4 shares, 12 do
    (3, 3, 4, 0),    # no number of 3-sample groups up to 3 splits into 4
    (4, 3, 4, 4),    # 12 samples
    (0, 8, 2, 0),    # everything was filtered
])
def test_usable_groups_keeps_the_most_whole_groups_that_split_evenly(kept, g, unit, expected):
    assert usable_groups(kept, g, unit) == expected


@pytest.mark.parametrize("dp,m", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_share_indices_same_minibatches_either_way_and_balanced_by_tokens(dp, m):
    import random

    from moe_rl.loop import share_indices

    rng = random.Random(dp * 10 + m)
    lengths = [rng.randint(16, 1024) for _ in range(32)]
    plain = [share_indices(lengths, dp, r, m, by_tokens=False) for r in range(dp)]
    packed = [share_indices(lengths, dp, r, m, by_tokens=True) for r in range(dp)]
    for k in range(m):
        a = sorted(i for r in range(dp) for i in plain[r][k])
        b = sorted(i for r in range(dp) for i in packed[r][k])
        assert a == b, "minibatch k holds the same samples whichever way it is spread"
        assert all(len(plain[r][k]) == 32 // (dp * m) for r in range(dp))
        tok_packed = [sum(lengths[i] for i in packed[r][k]) for r in range(dp)]
        assert max(tok_packed) - min(tok_packed) <= max(lengths)  # the greedy rule's bound
    assert sorted(i for r in range(dp) for mb in plain[r] for i in mb) == list(range(32))


def test_share_indices_refuses_uneven_split():
    from moe_rl.loop import share_indices

    with pytest.raises(ValueError, match="2 data-parallel ranks x 2 minibatches.*multiple of 4"):
        share_indices([5] * 6, 2, 0, 2, by_tokens=False)


def test_share_indices_by_tokens_lowers_the_busiest_rank():
    """Over many batches with lengths 16..1024 the busiest rank holds fewer tokens on average."""
    import random

    from moe_rl.loop import share_indices

    rng = random.Random(0)
    busiest = {False: 0, True: 0}
    for _ in range(50):
        lengths = [rng.randint(16, 1024) for _ in range(64)]
        for by_tokens in busiest:
            shares = [share_indices(lengths, 4, r, 2, by_tokens)[0] for r in range(4)]
            busiest[by_tokens] += max(sum(lengths[i] for i in s) for s in shares)
    assert busiest[True] < 0.9 * busiest[False]


class _OneRank:
    """What `combine_loss_metrics` needs of a Policy, for a single process."""

    reports_loss = True

    def all_reduce_sum(self, values, group="dp"):
        return values

    def all_reduce_max(self, values, group="dp"):
        return values


def test_combine_loss_metrics_over_microbatches():
    from moe_rl.loop import combine_loss_metrics

    mbs = [
        {"loss/pg_loss": 0.25, "loss/num_tokens": 10.0, "loss/ratio_mean": 1.0, "loss/ratio_min": 0.9,
         "loss/ratio_max": 1.1, "loss/clip_frac_high": 0.0},
        {"loss/pg_loss": -0.5, "loss/num_tokens": 30.0, "loss/ratio_mean": 2.0, "loss/ratio_min": 0.8,
         "loss/ratio_max": 1.05, "loss/clip_frac_high": 0.5},
        # an ignored microbatch (padding rows only): no tokens, extremes of an empty set
        {"loss/pg_loss": 0.0, "loss/num_tokens": 0.0, "loss/ratio_mean": 0.0, "loss/ratio_min": 0.0,
         "loss/ratio_max": 0.0, "loss/clip_frac_high": 0.0},
    ]
    out = combine_loss_metrics(_OneRank(), mbs)
    assert out["loss/pg_loss"] == pytest.approx(-0.25)  # shares of a globally normalised loss add up
    assert out["loss/num_tokens"] == 40.0
    assert out["loss/ratio_mean"] == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)  # token-weighted mean
    assert out["loss/clip_frac_high"] == pytest.approx(30 * 0.5 / 40)
    assert out["loss/ratio_min"] == pytest.approx(0.8) and out["loss/ratio_max"] == pytest.approx(1.1)


def test_combine_loss_metrics_rank_without_metrics_contributes_nothing():
    from moe_rl.loop import combine_loss_metrics

    class Stage(_OneRank):
        reports_loss = False

    out = combine_loss_metrics(Stage(), [{"loss/pg_loss": 1.0, "loss/num_tokens": 5.0, "loss/ratio_min": 0.5}])
    assert out == {}  # alone, a rank that does not report has nothing to combine
