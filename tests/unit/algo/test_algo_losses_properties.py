"""Properties the objectives must have: on-policy gradients, equivalences, clipping, stability."""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import AGG_MODES, LOSSES, aggregate, compute_loss

DT = torch.float64
NAMES = ["grpo", "dapo", "gspo", "gspo_token", "sapo"]


def batch(seed: int = 0, b: int = 5, t: int = 9, spread: float = 0.0, per_token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(b, t, generator=g, dtype=DT) * 2
    logp = (old + spread * torch.randn(b, t, generator=g, dtype=DT)).requires_grad_()
    adv = torch.randn((b, t) if per_token_adv else (b,), generator=g, dtype=DT)
    return logp, old, adv, mask


def grad_of(name, logp, old, adv, mask, **kw):
    loss, metrics = compute_loss(name, logp=logp, old_logp=old, advantages=adv, mask=mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, metrics


def single(name, log_ratio: float, a: float, **kw):
    """One sequence of one token: loss and d loss / d logp."""
    logp = torch.tensor([[log_ratio]], dtype=DT, requires_grad=True)
    old = torch.zeros(1, 1, dtype=DT)
    loss, grad, m = grad_of(name, logp, old, torch.tensor([a], dtype=DT), torch.ones(1, 1, dtype=torch.bool), **kw)
    return loss.item(), grad.item(), m


# --- on-policy: every objective is the plain policy gradient at r = 1 ----------


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", NAMES)
def test_gradient_at_ratio_one_is_policy_gradient(name, agg):
    for per_token in ([False] if name == "gspo" else [False, True]):
        logp, _, adv, mask = batch(seed=1, per_token_adv=per_token)
        _, grad, _ = grad_of(name, logp, logp.detach(), adv, mask, agg=agg)
        token_adv = adv if per_token else adv[:, None].expand_as(logp)
        pg = aggregate(-token_adv * logp, mask, agg)
        (expected,) = torch.autograd.grad(pg, logp)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


# --- GSPO-token equals GSPO with per-sequence advantages ------------------------


@pytest.mark.parametrize("kw", [{}, {"dual_clip": 2.0}, {"eps_low": 0.05, "eps_high": 0.08}])
@pytest.mark.parametrize("spread", [1e-4, 1e-3, 0.3, 2.0])
def test_gspo_token_equals_gspo_for_sequence_advantages(spread, kw):
    logp, old, adv, mask = batch(seed=2, b=8, spread=spread)
    for agg in AGG_MODES:
        loss_s, grad_s, m_s = grad_of("gspo", logp, old, adv, mask, agg=agg, **kw)
        loss_t, grad_t, m_t = grad_of("gspo_token", logp, old, adv, mask, agg=agg, **kw)
        torch.testing.assert_close(loss_t, loss_s, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad_t, grad_s, rtol=1e-10, atol=1e-14)
        assert m_t == pytest.approx(m_s)


@pytest.mark.parametrize("shift", [11.0, -11.0, 10.5])
def test_gspo_token_equals_gspo_past_the_sequence_clamp(shift):
    # rows whose mean log-ratio is beyond max_log_ratio (10): GSPO's clamp stops their gradient,
    # and GSPO-token's must stop too (it had the token ratio's gradient there: 688 per token)
    logp, old, adv, mask = batch(seed=3, b=8, spread=0.3)
    far = torch.tensor([True, False, True, False, False, True, False, False])
    with torch.no_grad():
        logp[far] += shift
    adv = -adv.abs()  # Â < 0: the unclipped branch, where a wrong gradient shows
    for agg in AGG_MODES:
        loss_s, grad_s, _ = grad_of("gspo", logp, old, adv, mask, agg=agg)
        loss_t, grad_t, _ = grad_of("gspo_token", logp, old, adv, mask, agg=agg)
        assert grad_s[far].abs().max() == 0.0
        torch.testing.assert_close(loss_t, loss_s, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad_t, grad_s, rtol=1e-10, atol=1e-14)


# --- SAPO's soft gate -------------------------------------------------------------


@pytest.mark.parametrize("a", [1.3, -0.7, 0.0])
def test_sapo_gradient_weight_is_sech_squared(a):
    tau = 1.0 if a > 0 else 1.05  # Â = 0 is "not positive": τ_neg
    for r in [0.3, 0.9, 1.0, 1.1, 2.5, 6.0]:
        _, grad, m = single("sapo", math.log(r), a)
        weight = 1 / math.cosh(tau * (r - 1) / 2) ** 2
        # d(−f(r)·Â)/d log π = −f'(r)·r·Â and f'(r) = sech²(τ(r−1)/2)
        assert grad == pytest.approx(-weight * r * a, rel=1e-12, abs=1e-15)
        assert m["loss/sapo_grad_weight_mean"] == pytest.approx(weight, rel=1e-12)
        assert m["loss/sapo_gate_mean"] == pytest.approx(1 / (1 + math.exp(-tau * (r - 1))), rel=1e-12)


def test_sapo_weight_is_one_on_policy_and_uses_tau_neg():
    for a in [2.0, -2.0]:
        _, grad, m = single("sapo", 0.0, a)
        assert m["loss/sapo_grad_weight_mean"] == 1.0 and grad == pytest.approx(-a)
    r = 1.8
    _, _, m_pos = single("sapo", math.log(r), 1.0, tau_pos=1.0, tau_neg=3.0)
    _, _, m_neg = single("sapo", math.log(r), -1.0, tau_pos=1.0, tau_neg=3.0)
    assert m_pos["loss/sapo_grad_weight_mean"] == pytest.approx(1 / math.cosh(0.4) ** 2)
    assert m_neg["loss/sapo_grad_weight_mean"] == pytest.approx(1 / math.cosh(1.2) ** 2)


def test_sapo_has_no_hard_clip():
    # a GRPO token past the clip gets no gradient; SAPO's gradient only shrinks
    for r in [1.5, 3.0]:
        assert single("grpo", math.log(r), 1.0)[1] == 0.0
        assert single("sapo", math.log(r), 1.0)[1] < 0.0


# --- clipping at and just past the boundaries -------------------------------------


CLIPPED = [("grpo", 0.2, 0.2), ("dapo", 0.2, 0.28), ("gspo", 3e-4, 4e-4), ("gspo_token", 3e-4, 4e-4)]


@pytest.mark.parametrize("name,eps_low,eps_high", CLIPPED)
def test_clip_boundaries(name, eps_low, eps_high):
    tiny = 1e-9
    hi, lo = math.log(1 + eps_high), math.log(1 - eps_low)
    # positive advantage: the upper bound clips, the lower one does not
    loss, grad, m = single(name, hi, 2.0)
    assert loss == pytest.approx(-(1 + eps_high) * 2.0, rel=1e-12)
    assert grad == pytest.approx(-(1 + eps_high) * 2.0, rel=1e-12) and m["loss/clip_frac_high"] == 0.0
    loss, grad, m = single(name, hi + tiny, 2.0)
    assert loss == pytest.approx(-(1 + eps_high) * 2.0, rel=1e-12)
    assert grad == 0.0 and m["loss/clip_frac_high"] == 1.0
    assert single(name, lo - 0.5, 2.0)[1] < 0.0  # far below: still pushed up
    # negative advantage: the lower bound clips, the upper one does not
    loss, grad, m = single(name, lo, -2.0)
    assert loss == pytest.approx((1 - eps_low) * 2.0, rel=1e-12)
    assert grad == pytest.approx((1 - eps_low) * 2.0, rel=1e-12) and m["loss/clip_frac_low"] == 0.0
    loss, grad, m = single(name, lo - tiny, -2.0)
    assert loss == pytest.approx((1 - eps_low) * 2.0, rel=1e-12)
    assert grad == 0.0 and m["loss/clip_frac_low"] == 1.0
    assert single(name, hi + 0.5, -2.0)[1] > 0.0  # far above: still pushed down


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token"])
def test_dual_clip_caps_negative_advantage_loss(name):
    c = 3.0
    loss, grad, m = single(name, math.log(c) - 1e-9, -1.0, dual_clip=c)
    assert grad > 0.0 and m["loss/dual_clip_frac"] == 0.0
    loss, grad, m = single(name, math.log(c) + 1e-9, -1.0, dual_clip=c)
    assert loss == pytest.approx(c) and grad == 0.0 and m["loss/dual_clip_frac"] == 1.0
    loss, grad, _ = single(name, math.log(50.0), -1.0, dual_clip=c)
    assert loss == pytest.approx(c) and grad == 0.0
    # positive advantages are untouched by the dual clip
    assert single(name, math.log(50.0), 1.0, dual_clip=c)[0] == single(name, math.log(50.0), 1.0)[0]


def test_gspo_clips_whole_sequences():
    # one token far off, the rest on-policy: GSPO's sequence ratio is the geometric mean
    logp = torch.tensor([[0.0, 0.0, 0.0, 3e-3]], dtype=DT, requires_grad=True)
    loss, grad, m = grad_of("gspo", logp, torch.zeros(1, 4, dtype=DT), torch.tensor([1.0], dtype=DT),
                            torch.ones(1, 4, dtype=torch.bool))
    assert m["loss/ratio_mean"] == pytest.approx(math.exp(3e-3 / 4))  # s = exp(7.5e-4) > 1 + 4e-4
    assert (grad == 0).all() and m["loss/clip_frac_high"] == 1.0 and m["loss/seq_clip_frac_high"] == 1.0


# --- DAPO token-level vs GRPO sequence-level weighting ----------------------------


def test_dapo_token_mean_weights_long_sequences_by_length():
    long_len, short_len = 8, 2
    mask = torch.zeros(2, long_len, dtype=torch.bool)
    mask[0, :long_len] = True
    mask[1, :short_len] = True
    logp = torch.full((2, long_len), -1.0, dtype=DT, requires_grad=True)
    adv = torch.tensor([1.0, 1.0], dtype=DT)
    totals = {}
    for name in ["dapo", "grpo"]:
        _, grad, _ = grad_of(name, logp, logp.detach(), adv, mask)
        totals[name] = (grad[0].sum() / grad[1].sum()).item()
        per_token = (grad[0, 0] / grad[1, 0]).item()
        # DAPO: every token weighs the same; GRPO: every sequence does
        assert per_token == pytest.approx(1.0 if name == "dapo" else short_len / long_len)
    assert totals["dapo"] == pytest.approx(long_len / short_len)
    assert totals["grpo"] == pytest.approx(1.0)


# --- stability --------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_extreme_ratios_empty_rows_and_single_tokens_stay_finite(name):
    t = 6
    mask = torch.zeros(5, t, dtype=torch.bool)
    mask[0, :] = True      # long
    mask[1, :1] = True     # single token
    mask[3, :3] = True     # row 2 and row 4 are all padding
    old = torch.zeros(5, t, dtype=DT)
    log_ratio = torch.tensor([50.0, -50.0] * 15, dtype=DT).reshape(5, t)
    log_ratio[1, 0] = 50.0
    log_ratio[3] = -50.0
    logp = (old + log_ratio).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 3.0], dtype=DT)
    for agg in AGG_MODES:
        for kw in [{}, {"rollout_logp": old - 50.0, "tis_level": "sequence"},
                   {"rollout_logp": old + 50.0, "ref_logp": old + 50.0, "beta": 0.1}]:
            loss, grad, m = grad_of(name, logp, old, adv, mask, agg=agg, **kw)
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), (agg, kw)
            assert all(math.isfinite(v) for v in m.values()), (agg, kw)
            assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_all_padding_batch_gives_zero_loss_and_gradient(name):
    logp = torch.full((3, 4), -math.inf, dtype=DT, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    loss, grad, m = grad_of(name, logp, torch.zeros(3, 4, dtype=DT), torch.ones(3, dtype=DT), mask,
                            ref_logp=torch.zeros(3, 4, dtype=DT), beta=0.1)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert m["loss/num_tokens"] == 0.0 and all(math.isfinite(v) for v in m.values())


def test_low_precision_inputs_are_computed_in_float32():
    logp, old, adv, mask = batch(seed=3, spread=0.1)
    low = [x.detach().bfloat16() for x in (logp, old, adv)]
    loss, _ = compute_loss("grpo", logp=low[0], old_logp=low[1], advantages=low[2], mask=mask)
    upcast, _ = compute_loss("grpo", logp=low[0].float(), old_logp=low[1].float(), advantages=low[2].float(),
                             mask=mask)
    assert loss.dtype == torch.float32 and loss.item() == upcast.item()


# --- errors -------------------------------------------------------------------------


def call(name="grpo", **kw):
    logp, old, adv, mask = batch()
    return compute_loss(name, logp=logp, old_logp=old, advantages=adv, mask=mask, **kw)


def test_unknown_loss_lists_known_ones():
    with pytest.raises(ValueError, match="unknown loss .ppo2.; known losses: cispo, dapo, gmpo, grpo, gspo, gspo_token, sapo"):
        call("ppo2")


@pytest.mark.parametrize("name,kw,text", [
    ("grpo", {"eps_low": -0.1}, "grpo: eps_low must be in [0, 1), got -0.1"),
    ("dapo", {"eps_high": -1.0}, "dapo: eps_high must be >= 0, got -1.0"),
    ("gspo", {"eps_low": 1.0}, "gspo: eps_low must be in [0, 1), got 1.0"),
    ("gspo_token", {"dual_clip": 0.5}, "gspo_token: dual_clip must be None or > 1, got 0.5"),
    ("grpo", {"max_log_ratio": 0.0}, "grpo: max_log_ratio must be > 0, got 0.0"),
    ("sapo", {"tau_pos": 0.0}, "sapo: tau_pos must be > 0, got 0.0"),
    ("sapo", {"tau_neg": -1.05}, "sapo: tau_neg must be > 0, got -1.05"),
    ("grpo", {"eps_low": float("nan")}, "grpo: eps_low must be in [0, 1), got nan"),
    ("grpo", {"agg": "sum"}, "compute_loss: unknown aggregation mode 'sum'; choose one of seq-mean-token-mean, "
                             "seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"),
    ("grpo", {"epsilon": 0.2}, "compute_loss: unknown parameter(s) 'epsilon' for loss 'grpo'; "
                               "accepted: eps_low, eps_high, dual_clip, max_log_ratio"),
    ("sapo", {"eps_low": 0.2}, "unknown parameter(s) 'eps_low' for loss 'sapo'; accepted: tau_pos, tau_neg"),
    ("grpo", {"tis_cap": 0.0}, "compute_loss: tis_cap must be None or > 0, got 0.0"),
    ("grpo", {"tis_level": "batch"}, "compute_loss: unknown tis_level 'batch'; choose one of sequence, token"),
    ("grpo", {"beta": -0.1}, "compute_loss: beta must be >= 0, got -0.1"),
    ("grpo", {"beta": 0.1}, "compute_loss: ref_logp must be given when beta > 0 (beta=0.1), got None"),
    ("grpo", {"kl_estimator": "k4"}, "compute_loss: unknown KL estimator 'k4'; choose one of k1, k2, k3"),
    ("grpo", {"global_num_tokens": -3}, "aggregate: global_num_tokens must be >= 0, got -3"),
    ("dapo", {"agg": "seq-mean-token-sum-norm", "max_len": 0}, "aggregate: max_len must be > 0, got 0"),
])
def test_bad_hyperparameters_name_parameter_and_value(name, kw, text):
    with pytest.raises(ValueError) as info:
        call(name, **kw)
    assert text in str(info.value)


def test_bad_shapes_are_reported():
    logp, old, adv, mask = batch(b=5, t=9)
    with pytest.raises(ValueError, match=r"advantages.shape must be \[B\] or \[B, T\]"):
        compute_loss("grpo", logp=logp, old_logp=old, advantages=adv[:3], mask=mask)
    with pytest.raises(ValueError, match=r"mask.shape must be logp's \(5, 9\), got \(5, 8\)"):
        compute_loss("grpo", logp=logp, old_logp=old, advantages=adv, mask=mask[:, :8])


# --- registry ------------------------------------------------------------------------


def test_registry_defaults_and_extension():
    assert LOSSES["gspo"].defaults == {"eps_low": 3e-4, "eps_high": 4e-4, "dual_clip": None, "max_log_ratio": 10.0}
    assert LOSSES["dapo"].defaults["eps_high"] == 0.28 and LOSSES["dapo"].agg == "token-mean"
    assert LOSSES["sapo"].defaults == {"tau_pos": 1.0, "tau_neg": 1.05, "max_log_ratio": 20.0}
    assert {n: LOSSES[n].agg for n in ["grpo", "gspo", "gspo_token", "sapo"]} == dict.fromkeys(
        ["grpo", "gspo", "gspo_token", "sapo"], "seq-mean-token-mean")

    from moe_rl.algo import Objective, register_loss

    @register_loss("test_only_plain_pg", agg="token-mean")
    def plain_pg(log_ratio, adv, mask, *, scale: float = 1.0):
        ratio = torch.exp(log_ratio)
        return Objective(loss=-scale * ratio * adv, ratio=ratio.detach())

    try:
        logp, _, adv, mask = batch(seed=4)
        loss, _ = compute_loss("test_only_plain_pg", logp=logp, old_logp=logp.detach(), advantages=adv,
                               mask=mask, scale=2.0)
        expected = aggregate(-2.0 * adv[:, None].expand_as(logp) * torch.ones_like(logp), mask, "token-mean")
        torch.testing.assert_close(loss, expected)
        with pytest.raises(ValueError, match="already registered"):
            register_loss("test_only_plain_pg", agg="token-mean")(plain_pg)
    finally:
        LOSSES.pop("test_only_plain_pg")
