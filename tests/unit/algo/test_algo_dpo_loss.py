"""`dpo_loss` against the papers' formulas written here with scalar Python maths.

DPO: −log σ(β·h), h = (log π_c − log π_ref,c) − (log π_r − log π_ref,r); conservative
DPO with label smoothing ε: −(1 − ε)·log σ(β·h) − ε·log σ(−β·h); IPO: (h − 1/(2β))².
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo.losses import dpo_loss

DT = torch.float64
B = 7


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pc, pr = -torch.rand(B, generator=g, dtype=DT) * 20, -torch.rand(B, generator=g, dtype=DT) * 20
    rc, rr = pc + torch.randn(B, generator=g, dtype=DT), pr + torch.randn(B, generator=g, dtype=DT)
    return pc.requires_grad_(), pr.requires_grad_(), rc, rr


def reference(pc, pr, rc, rr, beta, eps=0.0, kind="sigmoid", sft=0.0, lens=None):
    """Mean over pairs of the per-pair loss, one pair at a time."""
    total = 0.0
    for i in range(len(pc)):
        h = (pc[i] - rc[i]) - (pr[i] - rr[i])
        if kind == "sigmoid":
            sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
            loss = -(1 - eps) * torch.log(sig(beta * h)) - eps * torch.log(sig(-beta * h))
        else:
            loss = (h - 1 / (2 * beta)) ** 2
        if sft:
            loss = loss - sft * pc[i] / lens[i]
        total = total + loss
    return total / len(pc)


@pytest.mark.parametrize("beta, eps, kind, sft", [(0.1, 0.0, "sigmoid", 0.0), (0.5, 0.0, "sigmoid", 0.0),
                                                  (0.1, 0.2, "sigmoid", 0.0), (0.1, 0.0, "ipo", 0.0),
                                                  (1.0, 0.0, "ipo", 0.0), (0.1, 0.1, "sigmoid", 0.5)])
def test_value_and_gradient_match_the_formula(beta, eps, kind, sft):
    pc, pr, rc, rr = batch()
    lens = torch.arange(1, B + 1, dtype=DT)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps, kind=kind, sft_coef=sft, chosen_len=lens)
    ref = reference(pc, pr, rc, rr, beta, eps, kind, sft, lens)
    assert torch.allclose(loss, ref, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(loss, (pc, pr))
    g_ref = torch.autograd.grad(ref, (pc, pr))
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_metrics_are_beta_scaled_log_ratios():
    pc, pr, rc, rr = batch(1)
    beta = 0.3
    _, m = dpo_loss(pc, pr, rc, rr, beta=beta)
    chosen, rejected = beta * (pc - rc).detach(), beta * (pr - rr).detach()
    assert m["dpo/chosen_reward"] == pytest.approx(float(chosen.mean()), abs=1e-12)
    assert m["dpo/rejected_reward"] == pytest.approx(float(rejected.mean()), abs=1e-12)
    assert m["dpo/reward_margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-12)
    assert m["dpo/reward_accuracy"] == pytest.approx(float((chosen > rejected).double().mean()), abs=1e-12)
    assert m["dpo/num_pairs"] == B


def test_at_pi_equal_ref_the_loss_is_log2_and_the_gradient_is_minus_half_beta():
    """At π = π_ref: loss log 2, and ∇loss = −β/2·(∇log π_c − ∇log π_r), checked through a model."""
    beta = 0.25
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 4, generator=g, dtype=DT, requires_grad=True)  # logits of a 4-token "policy"
    xc, xr = torch.randn(5, generator=g, dtype=DT), torch.randn(5, generator=g, dtype=DT)
    logp = lambda x, y: torch.log_softmax(x @ w, -1)[y]  # noqa: E731
    c, r = logp(xc, 1).reshape(1), logp(xr, 2).reshape(1)
    loss, m = dpo_loss(c, r, c.detach(), r.detach(), beta=beta)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)
    assert m["dpo/reward_accuracy"] == 0.0 and m["dpo/reward_margin"] == 0.0
    (grad,) = torch.autograd.grad(loss, w, retain_graph=True)
    gc, gr = torch.autograd.grad(c.sum(), w, retain_graph=True)[0], torch.autograd.grad(r.sum(), w)[0]
    assert torch.allclose(grad, -beta / 2 * (gc - gr), atol=1e-12)


def test_ipo_at_pi_equal_ref():
    pc, pr, _, _ = batch(2)
    loss, _ = dpo_loss(pc, pr, pc.detach(), pr.detach(), beta=0.5, kind="ipo")
    assert loss.item() == pytest.approx(1.0, abs=1e-12)  # (0 − 1/(2·0.5))²


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_splits_with_the_global_normaliser_add_up_to_the_whole_batch(kind):
    """Microbatches x data-parallel ranks, filler pairs with weight 0: the same loss and gradient."""
    pc, pr, rc, rr = batch(4)
    whole, _ = dpo_loss(pc, pr, rc, rr, beta=0.2, kind=kind, label_smoothing=0.1 if kind == "sigmoid" else 0.0)
    g_whole = torch.autograd.grad(whole, (pc, pr))
    parts = [[0, 1, 2], [3], [4, 5, 6]]  # e.g. rank 0: two microbatches, rank 1: one
    total = 0.0
    for idx in parts:
        idx_t = torch.tensor(idx + [idx[0]])  # one filler pair, as a padded microbatch has
        w = torch.tensor([1.0] * len(idx) + [0.0], dtype=DT)
        part, m = dpo_loss(pc[idx_t], pr[idx_t], rc[idx_t], rr[idx_t], beta=0.2, kind=kind, weight=w,
                           num_pairs=B, label_smoothing=0.1 if kind == "sigmoid" else 0.0)
        assert m["dpo/num_pairs"] == len(idx)
        total = total + part
    assert torch.allclose(total, whole, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(total, (pc, pr)), g_whole):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_bad_arguments_are_refused_with_the_name():
    pc, pr, rc, rr = batch()
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="kind"):
        dpo_loss(pc, pr, rc, rr, kind="kto")
    with pytest.raises(ValueError, match="chosen_len"):
        dpo_loss(pc, pr, rc, rr, sft_coef=0.1)
    with pytest.raises(ValueError, match="rejected_logp.shape"):
        dpo_loss(pc, pr[:3], rc, rr)
