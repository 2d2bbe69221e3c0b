"""The critic's clipped value loss and VAPO's NTP term: plain formulas, and exactness under
micro-batch / data-parallel splits with global normalisers."""
from __future__ import annotations

import pytest
import torch

from moe_rl.algo.losses import ntp_loss, value_loss

DT = torch.float64


def data(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(B, T, generator=g, dtype=DT)
    old = v + 0.4 * torch.randn(B, T, generator=g, dtype=DT)
    ret = torch.randn(B, T, generator=g, dtype=DT)
    mask = (torch.rand(B, T, generator=g) > 0.35).to(DT)
    mask[0] = 0  # an empty row
    logp = -torch.rand(B, T, generator=g, dtype=DT) * 3
    correct = torch.tensor([True, True, False, True, False, True])
    return v, old, ret, mask, logp, correct


def ref_value_loss(v, old, ret, mask, clip):
    terms = []
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            if mask[b, t]:
                a = (v[b, t] - ret[b, t]) ** 2
                if clip is not None:
                    vc = old[b, t] + min(max(v[b, t] - old[b, t], -clip), clip)
                    a = max(a, (vc - ret[b, t]) ** 2)
                terms.append(0.5 * a)
    return sum(terms) / len(terms)


@pytest.mark.parametrize("clip", [None, 0.2, 1.0])
def test_value_loss_matches_formula(clip):
    v, old, ret, mask, _, _ = data(seed=1)
    loss, metrics = value_loss(v, old, ret, mask, clip=clip)
    assert float(loss) == pytest.approx(float(ref_value_loss(v, old, ret, mask, clip)), rel=1e-12)
    assert metrics["loss/num_tokens"] == float(mask.sum())
    if clip is None:
        assert metrics["critic/value_clip_frac"] == 0.0


def test_value_clip_frac_and_gradient_cut():
    v = torch.tensor([[1.0, 0.0]], dtype=DT, requires_grad=True)
    old = torch.tensor([[0.0, 0.0]], dtype=DT)
    ret = torch.tensor([[2.0, 1.0]], dtype=DT)  # token 0: V moved 1.0 towards R, clip 0.2 binds
    loss, metrics = value_loss(v, old, ret, torch.ones(1, 2, dtype=DT), clip=0.2)
    loss.backward()
    assert metrics["critic/value_clip_frac"] == 0.5
    assert v.grad[0, 0] == 0  # the clipped branch is constant in V
    assert v.grad[0, 1] == pytest.approx(0.5 * 2 * (0.0 - 1.0) / 2)


def test_ntp_loss_matches_formula():
    _, _, _, mask, logp, correct = data(seed=2)
    m = mask.bool() & correct[:, None]
    assert float(ntp_loss(logp, mask, correct)) == pytest.approx(float(-logp[m].sum() / m.sum()), rel=1e-12)
    assert float(ntp_loss(logp, mask, torch.zeros(6, dtype=torch.bool))) == 0.0


def _pieces_sum(fn, pieces):
    total, grads = 0.0, []
    for piece in pieces:
        x = piece[0].clone().requires_grad_(True)
        loss = fn(x, *piece[1:])
        loss.backward()
        total += float(loss.detach())
        grads.append(x.grad)
    return total, torch.cat(grads)


@pytest.mark.parametrize("split", [[6], [3, 3], [1, 2, 3], [2, 2, 2]])
def test_value_and_ntp_losses_add_up_over_microbatches_and_ranks(split):
    """Pieces (micro-batches on DP ranks) normalised by the global count give the whole batch's
    loss and gradient."""
    v, old, ret, mask, logp, correct = data(seed=3)
    bounds = torch.tensor([0] + split).cumsum(0).tolist()
    cut = lambda t: [t[a:b] for a, b in zip(bounds, bounds[1:])]  # noqa: E731
    n_tok = float(mask.sum())
    n_pos = float((mask.bool() & correct[:, None]).sum())

    def vl(x, o, r, m):
        return value_loss(x, o, r, m, clip=0.2, global_num_tokens=n_tok)[0]

    def ntp(x, m, c):
        return ntp_loss(x, m, c, global_num_tokens=n_pos)

    whole_v, grad_v = _pieces_sum(lambda x, o, r, m: value_loss(x, o, r, m, clip=0.2)[0], [(v, old, ret, mask)])
    got_v, got_grad_v = _pieces_sum(vl, list(zip(cut(v), cut(old), cut(ret), cut(mask))))
    assert got_v == pytest.approx(whole_v, rel=1e-12)
    assert torch.allclose(got_grad_v, grad_v, atol=1e-15)
    whole_n, grad_n = _pieces_sum(ntp_loss, [(logp, mask, correct)])
    got_n, got_grad_n = _pieces_sum(ntp, list(zip(cut(logp), cut(mask), cut(correct))))
    assert got_n == pytest.approx(whole_n, rel=1e-12)
    assert torch.allclose(got_grad_n, grad_n, atol=1e-15)
