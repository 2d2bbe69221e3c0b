"""Every objective against a loop-based reference written from the papers' formulas.

The references walk sequences and tokens with Python loops on scalar tensors,
so they share no code (and no vectorisation tricks) with moe_rl.algo.losses.
Gradients are compared with autograd through the reference.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import AGG_MODES, LOSSES, compute_loss

DT = torch.float64
B, T = 6, 7
LENGTHS = [7, 3, 1, 0, 5, 7]  # includes a single-token and an empty sequence


def make_batch(seed: int, spread: float, per_token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3
    logp = old + spread * torch.randn(B, T, generator=g, dtype=DT)
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(shape, generator=g, dtype=DT)
    rollout = old + 0.5 * torch.randn(B, T, generator=g, dtype=DT)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=DT)
    # padding holds garbage, as real padded batches do; none of it may leak
    logp[~mask] = -math.inf
    old[~mask] = math.nan
    return logp.requires_grad_(), old, adv, mask, rollout, ref


# --- reference -----------------------------------------------------------------


def adv_at(adv, i, t):
    return adv[i] if adv.dim() == 1 else adv[i, t]


def clip_obj(ratio, a, eps_low, eps_high, dual_clip):
    obj = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    if dual_clip is not None and a < 0:
        obj = torch.maximum(obj, dual_clip * a)
    return obj


def ref_token_losses(name, logp, old, adv, mask, p):
    """Per-token losses as a dict {(i, t): scalar tensor} over valid tokens."""
    out = {}
    for i in range(B):
        n = int(mask[i].sum())
        if n == 0:
            continue
        log_s = sum(logp[i, t] - old[i, t] for t in range(n)) / n
        seq_adv = sum(adv_at(adv, i, t) for t in range(n)) / n
        for t in range(n):
            a = adv_at(adv, i, t)
            if name in ("grpo", "dapo"):
                r = torch.exp(logp[i, t] - old[i, t])
                out[i, t] = -clip_obj(r, a, p["eps_low"], p["eps_high"], p.get("dual_clip"))
            elif name == "gspo":
                s = torch.exp(log_s)
                out[i, t] = -clip_obj(s, seq_adv, p["eps_low"], p["eps_high"], p.get("dual_clip"))
            elif name == "gspo_token":
                s = torch.exp(log_s).detach() * torch.exp(logp[i, t] - logp[i, t].detach())
                out[i, t] = -clip_obj(s, a, p["eps_low"], p["eps_high"], p.get("dual_clip"))
            elif name == "sapo":
                r = torch.exp(logp[i, t] - old[i, t])
                tau = p["tau_pos"] if a > 0 else p["tau_neg"]
                out[i, t] = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            elif name == "cispo":
                # −sg(ŵ)·Â·log π_θ, less the constant −sg(ŵ)·Â·log π_old (same gradient)
                w = float(torch.exp(logp[i, t].detach() - old[i, t]))
                w = min(max(w, max(1 - p["eps_low"], 0.0)), 1 + p["eps_high"])
                out[i, t] = -w * a * (logp[i, t] - old[i, t])
            elif name == "gmpo":
                out[i, t] = -gmpo_geometric_mean(logp[i, :n] - old[i, :n], seq_adv, p)
    return out


def gmpo_geometric_mean(log_r, a, p):
    """GMPO's sequence objective in its product form: (∏_t |min(ρ_t·Â, clip(ρ_t)·Â)|)^(1/n)·sgn(Â)."""
    if a == 0:
        return log_r.sum() * 0.0
    prod = 1.0
    for lr in log_r:
        rho, clipped = torch.exp(lr), torch.clamp(torch.exp(lr), math.exp(-p["eps_low"]), math.exp(p["eps_high"]))
        prod = prod * torch.abs(torch.minimum(rho * a, clipped * a))
    return prod ** (1.0 / len(log_r)) * (1.0 if a > 0 else -1.0)


def ref_aggregate(per_tok, mask, agg):
    lengths = [int(mask[i].sum()) for i in range(B)]
    n_tok, n_seq = sum(lengths), sum(1 for n in lengths if n > 0)
    if agg == "token-mean":
        return sum(per_tok.values()) / n_tok
    total = 0.0
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        seq_sum = sum(per_tok[i, t] for t in range(n))
        total = total + {"seq-mean-token-mean": seq_sum / n, "seq-mean-token-sum": seq_sum,
                         "seq-mean-token-sum-norm": seq_sum / T}[agg]
    return total / n_seq


def ref_tis(old, rollout, mask, level, cap):
    w = {}
    for i in range(B):
        n = int(mask[i].sum())
        seq_log = sum(float(old[i, t] - rollout[i, t]) for t in range(n))
        for t in range(n):
            log_w = seq_log if level == "sequence" else float(old[i, t] - rollout[i, t])
            w[i, t] = min(math.exp(log_w), cap)
    return w


def ref_kl(logp, ref, mask, estimator):
    out = {}
    for i in range(B):
        for t in range(int(mask[i].sum())):
            x = logp[i, t] - ref[i, t]
            out[i, t] = {"k1": x, "k2": 0.5 * x * x, "k3": torch.exp(-x) - 1 + x}[estimator]
    return out


def full_params(name, overrides):
    return LOSSES[name].defaults | overrides


def check(name, logp, old, adv, mask, agg, overrides, extra_kwargs=None, ref_extra=None):
    loss, _ = compute_loss(name, logp=logp, old_logp=old, advantages=adv, mask=mask, agg=agg,
                           **overrides, **(extra_kwargs or {}))
    (grad,) = torch.autograd.grad(loss, logp)
    per_tok = ref_token_losses(name, logp, old, adv, mask, full_params(name, overrides))
    kl_term = None
    if ref_extra is not None:
        per_tok, kl_term = ref_extra(per_tok)
    expected = ref_aggregate(per_tok, mask, agg)
    if kl_term is not None:
        expected = expected + kl_term
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert torch.isfinite(grad).all()


# --- tests ---------------------------------------------------------------------

# spreads: 1e-3 keeps GSPO's sequence ratios near its narrow band; 0.4 clips many GRPO tokens
SPREADS = [1e-3, 0.4]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token", "sapo", "cispo", "gmpo"])
@pytest.mark.parametrize("spread", SPREADS)
def test_loss_matches_reference(name, agg, spread):
    logp, old, adv, mask, _, _ = make_batch(seed=15, spread=spread)
    check(name, logp, old, adv, mask, agg, {})
    _, m = compute_loss(name, logp=logp, old_logp=old, advantages=adv, mask=mask)
    if name == "cispo" and spread > 0.1:  # the IS weight is truncated on some tokens, never the gradient
        assert 0 < m["loss/is_weight_clip_frac_high"] < 1 and "loss/clip_frac_high" not in m
    elif name == "gmpo" and spread > 0.1:
        assert m["loss/clip_frac_low"] > 0 and m["loss/clip_frac_high"] > 0
    elif name not in ("sapo", "cispo", "gmpo") and (spread > 0.1 or name.startswith("gspo")):
        # the batch exercises both clips and the unclipped branch
        assert m["loss/clip_frac_low"] > 0 and m["loss/clip_frac_high"] > 0
        assert m["loss/clip_frac_low"] + m["loss/clip_frac_high"] < 1


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo_token", "sapo"])
def test_per_token_advantages_match_reference(name):
    logp, old, adv, mask, _, _ = make_batch(seed=2, spread=0.3, per_token_adv=True)
    for agg in AGG_MODES:
        check(name, logp, old, adv, mask, agg, {})


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token"])
def test_dual_clip_matches_reference(name):
    logp, old, adv, mask, _, _ = make_batch(seed=3, spread=1.5)
    params = {"dual_clip": 1.5, "eps_low": 0.1, "eps_high": 0.3}
    check(name, logp, old, adv, mask, LOSSES[name].agg, params)


def test_cispo_gradient_is_the_papers():
    """∇ of −sg(clip(r))·Â·log π_θ, written with the full log π_θ (not the log ratio)."""
    logp, old, adv, mask, _, _ = make_batch(seed=9, spread=0.4)
    loss, _ = compute_loss("cispo", logp=logp, old_logp=old, advantages=adv, mask=mask)
    (grad,) = torch.autograd.grad(loss, logp)
    valid = [(i, t) for i in range(B) for t in range(int(mask[i].sum()))]
    paper = 0.0
    for i, t in valid:
        w = min(math.exp(float(logp[i, t].detach() - old[i, t])), 1.28)
        paper = paper - w * adv[i] * logp[i, t] / len(valid)
    (expected,) = torch.autograd.grad(paper, logp)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_custom_hyperparameters_match_reference():
    logp, old, adv, mask, _, _ = make_batch(seed=4, spread=0.5)
    check("sapo", logp, old, adv, mask, "seq-mean-token-mean", {"tau_pos": 0.5, "tau_neg": 2.0})
    check("grpo", logp, old, adv, mask, "token-mean", {"eps_low": 0.1, "eps_high": 0.05})
    check("gspo", logp, old, adv, mask, "seq-mean-token-mean", {"eps_low": 0.05, "eps_high": 0.1})
    check("cispo", logp, old, adv, mask, "token-mean", {"eps_low": 0.2, "eps_high": 1.0})
    check("gmpo", logp, old, adv, mask, "seq-mean-token-mean", {"eps_low": 0.2, "eps_high": 0.3})


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_tis_matches_reference(name, level):
    logp, old, adv, mask, rollout, _ = make_batch(seed=5, spread=0.2)
    cap = 1.5

    def weigh(per_tok):
        w = ref_tis(old, rollout, mask, level, cap)
        return {k: v * w[k] for k, v in per_tok.items()}, None

    check(name, logp, old, adv, mask, LOSSES[name].agg, {},
          {"rollout_logp": rollout, "tis_level": level, "tis_cap": cap}, weigh)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("name", ["grpo", "sapo"])
def test_ref_kl_term_matches_reference(name, estimator):
    logp, old, adv, mask, _, ref = make_batch(seed=6, spread=0.2)
    beta, agg = 0.3, LOSSES[name].agg

    def add_kl(per_tok):
        return per_tok, beta * ref_aggregate(ref_kl(logp, ref, mask, estimator), mask, agg)

    check(name, logp, old, adv, mask, agg, {},
          {"ref_logp": ref, "beta": beta, "kl_estimator": estimator}, add_kl)


def test_metrics_match_loops_over_valid_tokens():
    logp, old, adv, mask, rollout, ref = make_batch(seed=7, spread=0.4)
    _, m = compute_loss("dapo", logp=logp, old_logp=old, advantages=adv, mask=mask,
                        rollout_logp=rollout, tis_cap=1.2, ref_logp=ref, kl_estimator="k2")
    valid = [(i, t) for i in range(B) for t in range(int(mask[i].sum()))]
    logp = logp.detach()
    ratios = [math.exp(float(logp[i, t] - old[i, t])) for i, t in valid]
    advs = [float(adv[i]) for i, _ in valid]
    n = len(valid)
    mean_adv = sum(advs) / n
    expected = {
        "loss/ratio_mean": sum(ratios) / n,
        "loss/ratio_min": min(ratios),
        "loss/ratio_max": max(ratios),
        "loss/clip_frac_high": sum(a > 0 and r > 1.28 for r, a in zip(ratios, advs)) / n,
        "loss/clip_frac_low": sum(a < 0 and r < 0.8 for r, a in zip(ratios, advs)) / n,
        "loss/approx_kl": sum(r - 1 - math.log(r) for r in ratios) / n,
        "loss/adv_mean": mean_adv,
        "loss/adv_std": math.sqrt(sum((a - mean_adv) ** 2 for a in advs) / n),
        "loss/tis_clip_frac": sum(float(old[i, t] - rollout[i, t]) > math.log(1.2) for i, t in valid) / n,
        "loss/ref_kl": sum(0.5 * float(logp[i, t] - ref[i, t]) ** 2 for i, t in valid) / n,
        "loss/num_tokens": n,
        "loss/num_seqs": sum(1 for x in LENGTHS if x > 0),
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert 0 < m["loss/clip_frac_high"] + m["loss/clip_frac_low"] < 1  # the batch exercises clipping
    assert all(isinstance(v, float) for v in m.values())


def test_gspo_seq_clip_fractions_are_token_weighted():
    logp, old, adv, mask, _, _ = make_batch(seed=8, spread=0.05)
    _, m = compute_loss("gspo", logp=logp, old_logp=old, advantages=adv, mask=mask)
    lengths = [int(mask[i].sum()) for i in range(B)]
    logp = logp.detach()
    low = high = 0
    for i, n in enumerate(lengths):
        if n:
            s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(n)) / n)
            low += n * (s < 1 - 3e-4)
            high += n * (s > 1 + 4e-4)
    assert m["loss/seq_clip_frac_low"] == pytest.approx(low / sum(lengths))
    assert m["loss/seq_clip_frac_high"] == pytest.approx(high / sum(lengths))
