"""Aggregation modes and their global normalisers: microbatch and data-parallel invariance."""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import AGG_MODES, Normalizers, aggregate, compute_loss, count_normalizers

DT = torch.float64
B, T = 8, 12
LENGTHS = [12, 3, 0, 7, 1, 12, 5, 9]
# two simulated data-parallel ranks, each with uneven microbatches
RANKS = [[[0], [1, 2, 3]], [[4, 5], [6, 7]]]


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    old = -torch.rand(B, T, generator=g, dtype=DT) * 2
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=DT)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=DT)
    rollout = old + 0.2 * torch.randn(B, T, generator=g, dtype=DT)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=DT)
    return logp, old, adv, mask, rollout, ref


def piece(rows, mask):
    """Row indices and the piece's own padded length (its longest sequence)."""
    idx = torch.tensor(rows)
    return idx, max(1, int(mask[idx].sum(-1).max()))


def loss_of(name, agg, logp, old, adv, mask, rollout, ref, rows=None, **norm):
    extra = dict(rollout_logp=rollout, ref_logp=ref, beta=0.05)
    if rows is None:
        return compute_loss(name, logp=logp, old_logp=old, advantages=adv, mask=mask, agg=agg, **extra)[0]
    idx, t = piece(rows, mask)
    sl = (idx, slice(0, t))
    extra = {k: (v[sl] if isinstance(v, torch.Tensor) else v) for k, v in extra.items()}
    return compute_loss(name, logp=logp[sl], old_logp=old[sl], advantages=adv[idx], mask=mask[sl],
                        agg=agg, **extra, **norm)[0]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token", "sapo"])
def test_microbatches_and_dp_shards_sum_to_the_whole_batch(name, agg):
    logp, old, adv, mask, rollout, ref = make_batch()
    whole = loss_of(name, agg, logp, old, adv, mask, rollout, ref)
    (whole_grad,) = torch.autograd.grad(whole, logp)

    # counts of every piece on every rank, summed: what an all-reduce would give each rank
    norm = sum((count_normalizers(mask[piece(mb, mask)[0]]) for rank in RANKS for mb in rank), Normalizers.zero())
    kw = dict(global_num_tokens=norm.num_tokens, global_num_seqs=norm.num_seqs, max_len=T)
    total, rank_grads = 0.0, []
    for rank in RANKS:
        losses = [loss_of(name, agg, logp, old, adv, mask, rollout, ref, rows=mb, **kw) for mb in rank]
        rank_grads.append(torch.autograd.grad(sum(losses), logp)[0])  # gradient accumulation
        total = total + sum(losses).detach()
    # DDP averages gradients over ranks; scaling by the world size undoes it
    dp_grad = torch.stack(rank_grads).mean(0) * len(RANKS)

    torch.testing.assert_close(total, whole.detach(), rtol=0, atol=1e-12)
    assert (dp_grad - whole_grad).abs().max() <= 1e-12


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_local_normalisers_would_not_be_invariant(agg):
    # the check above is sensitive: averaging per-piece means weights pieces wrongly
    logp, old, adv, mask, rollout, ref = make_batch()
    whole = loss_of("grpo", agg, logp, old, adv, mask, rollout, ref)
    pieces = [mb for rank in RANKS for mb in rank]
    local = sum(loss_of("grpo", agg, logp, old, adv, mask, rollout, ref, rows=mb) for mb in pieces) / len(pieces)
    assert abs(local.item() - whole.item()) > 1e-3


def test_modes_on_a_small_example():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0] * 4], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 4) / (4 * 2))
    assert aggregate(values, mask, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx(10 / 20)
    assert aggregate(values, mask, "token-mean", global_num_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(values, mask, "seq-mean-token-mean", global_num_seqs=torch.tensor(6)).item() == pytest.approx(1.0)


def test_masked_positions_may_hold_inf_and_nan():
    values = torch.tensor([[1.0, math.inf], [math.nan, -math.inf]], dtype=DT, requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]], dtype=torch.bool)
    for mode in AGG_MODES:
        out = aggregate(values, mask, mode)
        (grad,) = torch.autograd.grad(out, values)
        assert torch.isfinite(out) and torch.isfinite(grad).all() and grad[0, 1] == 0


def test_count_normalizers_skips_padding_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    n = count_normalizers(mask) + count_normalizers(mask[:1])
    assert (n.num_tokens.item(), n.num_seqs.item()) == (5, 3)
