"""Rollout correction (TIS, token / IcePop / sequence masks) against loops over tokens."""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import compute_loss
from moe_rl.algo.correction import DEFAULT_BOUNDS, rollout_correction

DT = torch.float64
LENGTHS = [6, 2, 0, 5]


def batch(seed: int = 0, spread: float = 0.9):
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3
    rollout = old + spread * torch.randn(B, T, generator=g, dtype=DT)
    logp = (old + 0.1 * torch.randn(B, T, generator=g, dtype=DT)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=DT)
    return logp, old, rollout, adv, mask


def keep_by_loop(old, rollout, mask, mode, low, high):
    """{(i, t): 0/1} over valid tokens: token ratios in [low, high], or the sequence's geometric mean."""
    keep = {}
    for i, n in enumerate(LENGTHS):
        log_r = [float(old[i, t] - rollout[i, t]) for t in range(n)]
        geo = math.exp(sum(log_r) / n) if n else 1.0
        for t in range(n):
            r = geo if mode == "seq_mask" else math.exp(log_r[t])
            keep[i, t] = 1.0 if low <= r <= high else 0.0
    return keep


@pytest.mark.parametrize("mode", ["token_mask", "icepop", "seq_mask"])
def test_masks_match_loops_and_report_what_they_dropped(mode):
    logp, old, rollout, adv, mask = batch(spread=0.9 if mode != "seq_mask" else 0.03)
    low, high = DEFAULT_BOUNDS[mode]
    keep = keep_by_loop(old, rollout, mask, mode, low, high)
    fix = rollout_correction(old, rollout, mask, mode=mode)
    for (i, t), k in keep.items():
        assert bool(fix.keep[i, t]) == bool(k), (i, t)
    dropped = [key for key, k in keep.items() if k == 0]
    assert 0 < len(dropped) < len(keep), "the batch exercises both sides of the band"
    assert float(fix.stats["correction/masked_token_frac"]) == pytest.approx(len(dropped) / len(keep))
    seqs = sum(1 for n in LENGTHS if n)
    assert float(fix.stats["correction/masked_seq_frac"]) == pytest.approx(len({i for i, _ in dropped}) / seqs)
    ratios = [math.exp(float(old[i, t] - rollout[i, t])) for i, t in keep]
    assert float(fix.stats["correction/ratio_min"]) == pytest.approx(min(ratios))
    assert float(fix.stats["correction/ratio_max"]) == pytest.approx(max(ratios))
    assert torch.equal(fix.weights, torch.ones_like(fix.weights))  # no TIS asked for


def masked_reference(name, logp, old, rollout, adv, keep, cap):
    """The loss by loops: masked tokens leave the objective (and GSPO's sequence ratio); each kept
    token's loss is weighted by min(pi_old / pi_rollout, cap); the batch's own token and sequence
    counts normalise."""
    eps_low, eps_high = (0.2, 0.28) if name == "dapo" else (3e-4, 4e-4)
    n_tok, n_seq = sum(LENGTHS), sum(1 for n in LENGTHS if n)
    total = 0.0
    for i, n in enumerate(LENGTHS):
        kept = [t for t in range(n) if keep[i, t]]
        if not kept:
            continue
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in kept) / len(kept))
        seq = 0.0
        for t in kept:
            r = s if name == "gspo" else torch.exp(logp[i, t] - old[i, t])
            obj = torch.minimum(r * adv[i], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i])
            seq = seq - obj * min(math.exp(float(old[i, t] - rollout[i, t])), cap)
        total = total + (seq / n_tok if name == "dapo" else seq / len(kept) / n_seq)
    return total


@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_masked_loss_matches_loops(name):
    logp, old, rollout, adv, mask = batch(seed=1, spread=0.5)
    low, high = 0.6, 1.8
    keep = keep_by_loop(old, rollout, mask, "token_mask", low, high)
    assert 0 < sum(1 for k in keep.values() if not k) < len(keep)
    loss, m = compute_loss(name, logp=logp, old_logp=old, advantages=adv, mask=mask, rollout_logp=rollout,
                           tis_cap=1.5, correction="token_mask", correction_bounds=(low, high))
    expected = masked_reference(name, logp, old, rollout, adv, keep, 1.5)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    grad, = torch.autograd.grad(loss, logp)
    expected_grad, = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert all(grad[i, t] == 0 for (i, t), k in keep.items() if not k)  # a masked token gets no gradient
    assert m["correction/masked_token_frac"] > 0 and "loss/tis_clip_frac" in m


def test_masks_stay_exact_under_micro_batch_splits():
    logp, old, rollout, adv, mask = batch(seed=2)
    n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())
    kw = dict(correction="icepop", tis_cap=None, global_num_tokens=n_tok, global_num_seqs=n_seq, max_len=6)
    whole, _ = compute_loss("gspo", logp=logp, old_logp=old, advantages=adv, mask=mask, rollout_logp=rollout, **kw)
    parts = sum(compute_loss("gspo", logp=logp[s], old_logp=old[s], advantages=adv[s], mask=mask[s],
                             rollout_logp=rollout[s], **kw)[0] for s in (slice(0, 1), slice(1, 4)))
    torch.testing.assert_close(whole, parts, rtol=1e-12, atol=1e-14)


def test_unknown_mode_and_bad_bounds_are_refused():
    _, old, rollout, _, mask = batch()
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(old, rollout, mask, mode="icepopp")
    with pytest.raises(ValueError, match="bounds"):
        rollout_correction(old, rollout, mask, mode="token_mask", bounds=(1.2, 2.0))
