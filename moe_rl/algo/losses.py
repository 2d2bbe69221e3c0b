"""Policy-gradient objectives behind one entry point, `compute_loss`.

Notation: r_{i,t} = π_θ(y_{i,t}) / π_old(y_{i,t}) is the token ratio of token t
of sequence i, Â the advantage, ε_low / ε_high the clip range.

| name          | per-token loss                                                  | defaults        | aggregation         |
|---------------|-----------------------------------------------------------------|-----------------|---------------------|
| ``grpo``      | −min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â)                         | ε = (0.2, 0.2)  | seq-mean-token-mean |
| ``dapo``      | same as grpo, clip-higher                                       | ε = (0.2, 0.28) | token-mean          |
| ``gspo``      | −min(s_i·Â_i, clip(s_i, ...)·Â_i), s_i = exp(mean_t log r)      | ε = (3e-4, 4e-4)| seq-mean-token-mean |
| ``gspo_token``| same, s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)], per-token Â      | ε = (3e-4, 4e-4)| seq-mean-token-mean |
| ``sapo``      | −σ(τ(r−1))·4/τ·Â, τ = τ_pos if Â > 0 else τ_neg (no hard clip)  | τ = (1.0, 1.05) | seq-mean-token-mean |
| ``cispo``     | −sg(clip(r, 1−ε_low, 1+ε_high))·Â·log π_θ                       | ε = (1.0, 0.28) | token-mean          |
| ``gmpo``      | −exp(mean_t s·min(s·log r, s·clip(log r, −ε_low, ε_high)))·Â_i  | ε = (0.4, 0.4)  | seq-mean-token-mean |

Every loss's ratio is computed from clamped log-ratios (``max_log_ratio``,
20 per token, 10 for GSPO's sequence ratio) so that exp cannot overflow.

The clipped objectives take ``dual_clip=c`` (e.g. 3.0): for Â < 0 the loss
is capped at −c·Â, so one token whose ratio exploded cannot dominate the step.

Rollout correction (TIS, token / IcePop / sequence masks) multiplies any objective's
per-token loss: see `moe_rl.algo.correction`.

Adding an objective is one function: keyword-only
hyperparameters with their defaults, decorated with
``@register_loss("name", agg="<default aggregation>")``, mapping
``(log_ratio, adv, mask)`` to an `Objective`. `compute_loss` does the rest:
validation, importance correction, aggregation, KL term and metrics.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moe_rl.algo._checks import require, require_choice
from moe_rl.algo.aggregation import (
    AGG_MODES,
    Count,
    aggregate,
    masked_max,
    masked_mean,
    masked_min,
    masked_seq_mean,
)
from moe_rl.algo.kl import KL_ESTIMATORS, kl_estimate
from moe_rl.algo.correction import rollout_correction
from moe_rl.algo.tis import TIS_LEVELS


@dataclass
class Objective:
    """What an objective returns; every tensor is `[B, T]`.

    `loss` is the per-token loss to minimise (autograd flows through it);
    `ratio` the importance ratio the objective used (detached, for metrics);
    `clip_low` / `clip_high` (bool) mark tokens where a clip binds and the
    gradient is cut; `extra` holds more per-token statistics, each reported as
    its mean over valid tokens under ``loss/<key>`` (bool tensors become fractions).
    Values at masked positions may be anything finite.
    """

    loss: Tensor
    ratio: Tensor
    clip_low: Tensor | None = None
    clip_high: Tensor | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)


ObjectiveFn = Callable[..., Objective]


@dataclass(frozen=True)
class LossSpec:
    """A registered objective: its function, default aggregation and hyperparameter defaults."""

    name: str
    fn: ObjectiveFn
    agg: str
    defaults: dict[str, Any]


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, agg: str) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register `fn(log_ratio, adv, mask, *, **hyperparameters) -> Objective` under `name`.

    The function receives `log_ratio` = log π_θ − log π_old `[B, T]` (zero at
    masked positions, carries the gradient), `adv` `[B, T]` (detached) and
    `mask` `[B, T]` (bool), and must validate its own hyperparameters.
    """
    require_choice(agg, AGG_MODES, f"register_loss({name!r})", "aggregation mode")

    def decorator(fn: ObjectiveFn) -> ObjectiveFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        params = inspect.signature(fn).parameters.values()
        defaults = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        LOSSES[name] = LossSpec(name, fn, agg, defaults)
        return fn

    return decorator


def get_loss(name: str) -> LossSpec:
    """The registered objective `name`; a `ValueError` lists the known ones otherwise."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


# --- objectives ---------------------------------------------------------------


def _check_clip(where: str, eps_low: float, eps_high: float, dual_clip: float | None,
                max_log_ratio: float) -> None:
    require(0 <= eps_low < 1, where, "eps_low", eps_low, "in [0, 1)")
    require(eps_high >= 0, where, "eps_high", eps_high, ">= 0")
    require(dual_clip is None or dual_clip > 1, where, "dual_clip", dual_clip, "None or > 1")
    require(max_log_ratio > 0, where, "max_log_ratio", max_log_ratio, "> 0")


def _clipped(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float,
             dual_clip: float | None) -> Objective:
    """−min(ratio·Â, clip(ratio, 1−ε_low, 1+ε_high)·Â), optionally dual-clipped; all `[B, T]`.

    A ratio exactly on a boundary is not clipped: its gradient still flows.
    """
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    ratio = ratio.detach()
    # where the clipped branch wins the objective is constant: these tokens get no gradient
    high = (ratio > 1 + eps_high) & (adv > 0)
    low = (ratio < 1 - eps_low) & (adv < 0)
    extra = {}
    if dual_clip is not None:
        # with Â < 0, −ratio·Â grows without bound in the ratio; cap the loss at −c·Â.
        # For Â >= 0 the objective is >= 0 = c·min(Â, 0), so the max leaves it alone.
        obj = torch.maximum(obj, dual_clip * adv.clamp(max=0))
        extra["dual_clip_frac"] = (ratio > dual_clip) & (adv < 0)
    return Objective(loss=-obj, ratio=ratio, clip_low=low, clip_high=high, extra=extra)


def _token_ratio(log_ratio: Tensor, max_log_ratio: float) -> Tensor:
    # clamp before exp: the gradient is zero past the clamp instead of inf
    return torch.exp(log_ratio.clamp(-max_log_ratio, max_log_ratio))


@register_loss("grpo", agg="seq-mean-token-mean")
def grpo(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 0.2,
         eps_high: float = 0.2, dual_clip: float | None = None,
         max_log_ratio: float = 20.0) -> Objective:
    """GRPO (PPO clip on token ratios): −min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â)."""
    _check_clip("grpo", eps_low, eps_high, dual_clip, max_log_ratio)
    return _clipped(_token_ratio(log_ratio, max_log_ratio), adv, eps_low, eps_high, dual_clip)


@register_loss("dapo", agg="token-mean")
def dapo(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 0.2,
         eps_high: float = 0.28, dual_clip: float | None = None,
         max_log_ratio: float = 20.0) -> Objective:
    """DAPO: GRPO's token objective with clip-higher (ε_high > ε_low) and token-mean aggregation.

    DAPO's dynamic sampling and overlong shaping act on the batch and the
    rewards; they live in `moe_rl.algo.filters`.
    """
    _check_clip("dapo", eps_low, eps_high, dual_clip, max_log_ratio)
    return _clipped(_token_ratio(log_ratio, max_log_ratio), adv, eps_low, eps_high, dual_clip)


def _seq_log_ratio(log_ratio: Tensor, mask: Tensor, max_log_ratio: float) -> Tensor:
    """log s_i = mean over valid tokens of log r_{i,t}, clamped; `[B, 1]`."""
    # clamp before exp: one long off-policy sequence must not overflow
    return masked_seq_mean(log_ratio, mask).clamp(-max_log_ratio, max_log_ratio)


def _seq_out_of_band(seq_ratio: Tensor, like: Tensor, eps_low: float, eps_high: float) -> dict[str, Tensor]:
    # per token, so the reported fraction is weighted by tokens
    return {
        "seq_clip_frac_low": (seq_ratio < 1 - eps_low).expand_as(like),
        "seq_clip_frac_high": (seq_ratio > 1 + eps_high).expand_as(like),
    }


@register_loss("gspo", agg="seq-mean-token-mean")
def gspo(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 3e-4,
         eps_high: float = 4e-4, dual_clip: float | None = None,
         max_log_ratio: float = 10.0) -> Objective:
    """GSPO: −min(s_i·Â_i, clip(s_i, 1−ε_low, 1+ε_high)·Â_i), s_i = exp(mean_t log r_{i,t}).

    The sequence's loss is placed on each of its tokens, so the default
    seq-mean-token-mean gives the paper's (1/G)·sum_i. Â_i is the mean of
    `adv` over the sequence's valid tokens (the sequence advantage, when it
    was broadcast); for advantages that vary along a sequence use gspo_token.
    """
    _check_clip("gspo", eps_low, eps_high, dual_clip, max_log_ratio)
    seq_ratio = torch.exp(_seq_log_ratio(log_ratio, mask, max_log_ratio))
    seq_adv = masked_seq_mean(adv, mask)
    out = _clipped(seq_ratio.expand_as(log_ratio), seq_adv.expand_as(adv), eps_low, eps_high, dual_clip)
    out.extra |= _seq_out_of_band(seq_ratio.detach(), log_ratio, eps_low, eps_high)
    return out


@register_loss("gspo_token", agg="seq-mean-token-mean")
def gspo_token(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 3e-4,
               eps_high: float = 4e-4, dual_clip: float | None = None,
               max_log_ratio: float = 10.0) -> Objective:
    """GSPO-token: GSPO's clip on s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)] with per-token Â.

    s_{i,t} has the value of s_i and the gradient of a token ratio, so with
    per-sequence advantages the loss and gradient equal GSPO's.
    """
    _check_clip("gspo_token", eps_low, eps_high, dual_clip, max_log_ratio)
    seq_log_ratio = masked_seq_mean(log_ratio, mask)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-max_log_ratio, max_log_ratio)).detach()
    # exp(x − sg[x]) is 1 in value and has the gradient of exp(x); a row past the clamp has
    # none, as in GSPO, where the clamp stops it (else: s_i·∇log π per token, e^10 of it)
    inside = (seq_log_ratio.abs() <= max_log_ratio).detach()
    token_ratio = seq_ratio * torch.exp(torch.where(inside, log_ratio - log_ratio.detach(), 0.0))
    out = _clipped(token_ratio, adv, eps_low, eps_high, dual_clip)
    out.extra |= _seq_out_of_band(seq_ratio, log_ratio, eps_low, eps_high)
    return out


@register_loss("sapo", agg="seq-mean-token-mean")
def sapo(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, tau_pos: float = 1.0,
         tau_neg: float = 1.05, max_log_ratio: float = 20.0) -> Objective:
    """SAPO: −f(r)·Â with the soft gate f(r) = σ(τ(r−1))·4/τ, τ = τ_pos if Â > 0 else τ_neg.

    The gradient is sech²(τ(r−1)/2)·r·Â·∇log π_θ: the weight is 1 at r = 1
    (the plain policy gradient) and decays smoothly away from it, so there is
    no hard clip. A larger τ_neg damps negative-advantage tokens faster.
    """
    require(tau_pos > 0, "sapo", "tau_pos", tau_pos, "> 0")
    require(tau_neg > 0, "sapo", "tau_neg", tau_neg, "> 0")
    require(max_log_ratio > 0, "sapo", "max_log_ratio", max_log_ratio, "> 0")
    ratio = _token_ratio(log_ratio, max_log_ratio)
    positive = (adv > 0).to(adv.dtype)  # Â = 0 counts as negative, as in the paper
    tau = positive * tau_pos + (1 - positive) * tau_neg
    gate = torch.sigmoid(tau * (ratio - 1))
    grad_weight = 4 * gate * (1 - gate)  # d f / d r = sech²(τ(r−1)/2)
    return Objective(
        loss=-(gate * (4 / tau) * adv),
        ratio=ratio.detach(),
        extra={"sapo_gate_mean": gate.detach(), "sapo_grad_weight_mean": grad_weight.detach()},
    )


@register_loss("cispo", agg="token-mean")
def cispo(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 1.0,
          eps_high: float = 0.28, max_log_ratio: float = 20.0) -> Objective:
    """CISPO (MiniMax-M1, 2025): −sg(clip(r, 1−ε_low, 1+ε_high))·Â·log π_θ, token-level.

    The importance weight is clipped and detached instead of the update, so every token keeps
    its gradient Â·∇log π_θ (scaled by the clipped weight). The paper sets no lower bound
    (ε_low large: here 1.0, a weight >= 0) and tunes only ε_high; 0.28 is the clip-higher
    bound most recipes start from. The value reported is −sg(ŵ)·Â·(log π_θ − log π_old):
    log π_old is a constant, so the gradient is CISPO's.
    """
    require(eps_low >= 0, "cispo", "eps_low", eps_low, ">= 0")
    require(eps_high >= 0, "cispo", "eps_high", eps_high, ">= 0")
    require(max_log_ratio > 0, "cispo", "max_log_ratio", max_log_ratio, "> 0")
    ratio = _token_ratio(log_ratio, max_log_ratio).detach()
    weight = ratio.clamp(max(1 - eps_low, 0.0), 1 + eps_high)
    return Objective(loss=-(weight * adv * log_ratio), ratio=ratio,
                     extra={"is_weight_clip_frac_low": ratio < 1 - eps_low,
                            "is_weight_clip_frac_high": ratio > 1 + eps_high, "is_weight_mean": weight})


@register_loss("gmpo", agg="seq-mean-token-mean")
def gmpo(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 0.4,
         eps_high: float = 0.4, max_log_ratio: float = 10.0) -> Objective:
    """GMPO (Zhao et al., 2025): the geometric mean of the clipped token objectives.

    −(∏_t min(r_t·Â, clip(r_t, e^−ε_low, e^ε_high)·Â))^{1/|o|} for a sequence advantage Â:
    in log space, with s = sign(Â), the sequence's log ratio is the mean over its tokens of
    s·min(s·log r_t, s·clip(log r_t, −ε_low, ε_high)), and the loss −exp(that)·Â sits on each
    of its tokens (the default seq-mean-token-mean averages sequences). Clipping per token
    in log space with the paper's ε = 0.4 keeps outlier tokens from moving the mean.
    """
    require(eps_low > 0, "gmpo", "eps_low", eps_low, "> 0")
    require(eps_high > 0, "gmpo", "eps_high", eps_high, "> 0")
    require(max_log_ratio > 0, "gmpo", "max_log_ratio", max_log_ratio, "> 0")
    seq_adv = masked_seq_mean(adv, mask)
    sign = torch.where(seq_adv >= 0, 1.0, -1.0).to(log_ratio.dtype)
    clipped = log_ratio.clamp(-eps_low, eps_high)
    token_log = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_log = masked_seq_mean(token_log, mask).clamp(-max_log_ratio, max_log_ratio)
    seq_ratio = torch.exp(seq_log)
    log_r = log_ratio.detach()
    return Objective(loss=-(seq_ratio * seq_adv).expand_as(log_ratio), ratio=torch.exp(log_r),
                     clip_low=(log_r < -eps_low) & (sign < 0), clip_high=(log_r > eps_high) & (sign > 0),
                     extra={"seq_ratio_mean": seq_ratio.detach().expand_as(log_ratio)})


# --- entry point --------------------------------------------------------------


def compute_loss(
    name: str,
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    agg: str | None = None,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_len: int | None = None,
    rollout_logp: Tensor | None = None,
    tis_level: str = "token",
    tis_cap: float | None = 2.0,
    correction: str | None = None,
    correction_bounds: tuple[float, float] | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    **params: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Loss of objective `name` (to minimise) and its metrics.

    Args:
        logp: `[B, T]` log π_θ of the sampled tokens; carries the gradient.
        old_logp: `[B, T]` log π_old (the policy that produced the data, as
            recomputed by the trainer); for a single on-policy update pass `logp.detach()`.
        advantages: `[B]` per sequence or `[B, T]` per token (treated as constants).
        mask: `[B, T]` bool or 0/1, true on response tokens that count.
        agg: one of `AGG_MODES`; default the objective's own (see the module table).
        global_num_tokens, global_num_seqs, max_len: normalisers of the whole
            step across microbatches and DP ranks (see `moe_rl.algo.aggregation`);
            default: counts of this call's batch and its padded length.
        rollout_logp: `[B, T]` log π_rollout from the inference engine; when given,
            each token's loss is weighted by min(π_old / π_rollout, tis_cap),
            per token or per sequence (`tis_level` "token" / "sequence"; `tis_cap`
            None: no truncated IS), and masked by `correction` ("token_mask",
            "icepop", "seq_mask" within `correction_bounds`; see `moe_rl.algo.correction`).
        ref_logp: `[B, T]` log π_ref; when given the KL(π_θ || π_ref) estimate
            (`kl_estimator` k1/k2/k3) is reported, and added as `beta`·KL
            (same aggregation) when `beta` > 0.
        **params: the objective's hyperparameters (see `LOSSES[name].defaults`).

    Returns:
        `(loss, metrics)`: a 0-dim tensor and a dict of floats under ``loss/...``,
        computed over the valid tokens of this call.
    """
    spec = get_loss(name)
    _check_call(spec, params, agg, tis_level, tis_cap, beta, kl_estimator, ref_logp)
    agg = spec.agg if agg is None else agg
    _check_shapes(logp, old_logp, advantages, mask, rollout_logp, ref_logp)

    mask = mask.bool()
    # ratios of bf16 log-probs are too coarse; do the maths in float32 at least
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    norm = dict(global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, max_len=max_len)
    stats: dict[str, Tensor] = {}
    scalars: dict[str, Tensor] = {}
    weights = None
    if rollout_logp is not None:
        fix = rollout_correction(old_logp.to(dtype), rollout_logp.to(dtype), mask, mode=correction,
                                 bounds=correction_bounds, tis_cap=tis_cap, tis_level=tis_level)
        weights, stats, scalars = fix.weights, fix.token_stats, fix.stats
        if not fix.keep.all():  # masked tokens leave the objective; the batch's normalisers stay
            norm |= _counts(mask, global_num_tokens, global_num_seqs)
            mask = mask & fix.keep
    adv = _token_advantages(advantages.detach().to(dtype), mask)
    log_ratio = _masked_diff(logp, old_logp.detach().to(dtype), mask)

    out = spec.fn(log_ratio, adv, mask, **params)
    per_token = out.loss if weights is None else out.loss * weights

    pg_loss = aggregate(per_token, mask, agg, **norm)
    loss = pg_loss
    scalars["pg_loss"] = pg_loss.detach()
    if ref_logp is not None:
        kl = kl_estimate(_masked_diff(logp, ref_logp.detach().to(dtype), mask), kl_estimator)
        scalars["ref_kl"] = masked_mean(kl.detach(), mask)
        if beta > 0:
            kl_loss = beta * aggregate(kl, mask, agg, **norm)
            loss = loss + kl_loss
            scalars["kl_loss"] = kl_loss.detach()
    return loss, _metrics(out, stats, scalars, log_ratio.detach(), adv, mask)


def _check_call(spec: LossSpec, params: dict[str, Any], agg: str | None, tis_level: str,
                tis_cap: float, beta: float, kl_estimator: str, ref_logp: Tensor | None) -> None:
    unknown = sorted(set(params) - set(spec.defaults))
    if unknown:
        raise ValueError(f"compute_loss: unknown parameter(s) {', '.join(map(repr, unknown))} for loss "
                         f"{spec.name!r}; accepted: {', '.join(spec.defaults)}")
    if agg is not None:
        require_choice(agg, AGG_MODES, "compute_loss", "aggregation mode")
    require_choice(tis_level, TIS_LEVELS, "compute_loss", "tis_level")
    require(tis_cap is None or tis_cap > 0, "compute_loss", "tis_cap", tis_cap, "None or > 0")
    require(beta >= 0, "compute_loss", "beta", beta, ">= 0")
    require(beta == 0 or ref_logp is not None, "compute_loss", "ref_logp", None,
            f"given when beta > 0 (beta={beta})")
    require_choice(kl_estimator, KL_ESTIMATORS, "compute_loss", "KL estimator")


def _check_shapes(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  rollout_logp: Tensor | None, ref_logp: Tensor | None) -> None:
    require(logp.dim() == 2, "compute_loss", "logp.shape", tuple(logp.shape), "[B, T]")
    named = {"old_logp": old_logp, "mask": mask, "rollout_logp": rollout_logp, "ref_logp": ref_logp}
    for key, t in named.items():
        if t is not None:
            require(t.shape == logp.shape, "compute_loss", f"{key}.shape", tuple(t.shape),
                     f"logp's {tuple(logp.shape)}")
    ok = advantages.shape in (logp.shape[:1], logp.shape)
    require(ok, "compute_loss", "advantages.shape", tuple(advantages.shape),
            f"[B] or [B, T] with [B, T] = {tuple(logp.shape)}")


def _counts(mask: Tensor, num_tokens: Count | None, num_seqs: Count | None) -> dict[str, Count]:
    """The normalisers of `mask`'s batch where the caller gave none."""
    return {"global_num_tokens": mask.sum() if num_tokens is None else num_tokens,
            "global_num_seqs": mask.any(-1).sum() if num_seqs is None else num_seqs}


def _token_advantages(adv: Tensor, mask: Tensor) -> Tensor:
    """`[B]` or `[B, T]` -> `[B, T]`, zero at masked positions (padding may hold garbage)."""
    if adv.dim() == 1:
        adv = adv[:, None].expand(mask.shape)
    return torch.where(mask, adv, 0.0)


def _masked_diff(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """a − b on valid tokens, 0 elsewhere: padding's log-probs may be -inf, and exp(inf)·0 is nan."""
    return torch.where(mask, a - b, 0.0)


def _metrics(out: Objective, stats: dict[str, Tensor], scalars: dict[str, Tensor],
             log_ratio: Tensor, adv: Tensor, mask: Tensor) -> dict[str, float]:
    """Metrics over valid tokens, gathered as tensors and moved to the host in one go."""
    weight = mask.to(adv.dtype)
    num_tokens = weight.sum()

    def mean(x: Tensor) -> Tensor:
        # a float product, not torch.where: inputs are finite at masked positions by
        # construction, and boolean selection is several times slower on CPU
        return (x.detach().to(weight.dtype) * weight).sum() / num_tokens.clamp(min=1)

    adv_mean = mean(adv)
    values = dict(scalars)
    values |= {
        "ratio_mean": mean(out.ratio),
        "ratio_min": masked_min(out.ratio, mask),
        "ratio_max": masked_max(out.ratio, mask),
        # k3 estimate of KL(π_old || π_θ): how far this update has moved the policy
        "approx_kl": mean(kl_estimate(-log_ratio, "k3")),
        "adv_mean": adv_mean,
        "adv_std": mean((adv - adv_mean).square()).sqrt(),
        "num_tokens": num_tokens,
        "num_seqs": (weight.sum(-1) > 0).sum(),
    }
    per_token_stats = dict(clip_frac_low=out.clip_low, clip_frac_high=out.clip_high) | out.extra | stats
    values |= {key: mean(x) for key, x in per_token_stats.items() if x is not None}
    host = torch.stack([v.detach().to(torch.float64) for v in values.values()]).tolist()
    # names with a namespace of their own (correction/...) keep it
    return {key if "/" in key else f"loss/{key}": value for key, value in zip(values, host)}


# --- preference objectives ------------------------------------------------------

DPO_KINDS = ("sigmoid", "ipo")


def dpo_loss(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen_logp: Tensor,
    ref_rejected_logp: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    kind: str = "sigmoid",
    sft_coef: float = 0.0,
    chosen_len: Tensor | None = None,
    weight: Tensor | None = None,
    num_pairs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """DPO (or IPO) loss of B preference pairs, and its metrics.

    Inputs are `[B]` summed response log-probs: `chosen_logp` / `rejected_logp` under
    π_θ (carry the gradient), `ref_*` under π_ref (treated as constants). With
    h = (log π_c − log π_ref,c) − (log π_r − log π_ref,r), the per-pair loss is

        sigmoid: −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)      (ε = label_smoothing: conservative DPO)
        ipo:     (h − 1/(2β))²

    plus `sft_coef` · (−log π_c / chosen_len) (the chosen response's per-token NLL;
    `chosen_len` `[B]` is needed when `sft_coef` > 0).

    `weight` `[B]` (0/1) marks the pairs that count (filler rows of a microbatch: 0) and
    `num_pairs` is the normaliser: loss = Σ_i weight_i·ℓ_i / num_pairs. Pass the number of
    pairs of the whole step (all microbatches, all data-parallel ranks) and the losses of
    any split add up to the loss of the whole batch; default: this call's weight sum.

    Metrics (means over counted pairs; rewards are β-scaled log-ratios β·(log π − log π_ref)):
    `dpo/reward_accuracy` (chosen reward > rejected reward), `dpo/reward_margin`,
    `dpo/chosen_reward`, `dpo/rejected_reward`, `loss/dpo` (this call's loss) and
    `dpo/num_pairs` (pairs counted here).
    """
    require_choice(kind, DPO_KINDS, "dpo_loss", "kind")
    require(beta > 0, "dpo_loss", "beta", beta, "> 0")
    require(0 <= label_smoothing < 0.5, "dpo_loss", "label_smoothing", label_smoothing, "in [0, 0.5)")
    require(kind == "sigmoid" or label_smoothing == 0, "dpo_loss", "label_smoothing", label_smoothing,
            "0 with kind='ipo' (label smoothing is conservative DPO's, for kind='sigmoid')")
    require(sft_coef >= 0, "dpo_loss", "sft_coef", sft_coef, ">= 0")
    require(sft_coef == 0 or chosen_len is not None, "dpo_loss", "chosen_len", None, "given when sft_coef > 0")
    for name, t in (("rejected_logp", rejected_logp), ("ref_chosen_logp", ref_chosen_logp),
                    ("ref_rejected_logp", ref_rejected_logp)):
        require(t.shape == chosen_logp.shape, "dpo_loss", f"{name}.shape", tuple(t.shape),
                f"chosen_logp's {tuple(chosen_logp.shape)}")
    dtype = torch.promote_types(chosen_logp.dtype, torch.float32)
    w = torch.ones_like(chosen_logp, dtype=dtype) if weight is None else weight.to(dtype)
    chosen_ratio = chosen_logp.to(dtype) - ref_chosen_logp.detach().to(dtype)
    rejected_ratio = rejected_logp.to(dtype) - ref_rejected_logp.detach().to(dtype)
    h = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        log_sigmoid = torch.nn.functional.logsigmoid
        per_pair = -(1 - label_smoothing) * log_sigmoid(beta * h) - label_smoothing * log_sigmoid(-beta * h)
    else:
        per_pair = (h - 1 / (2 * beta)).square()
    if sft_coef > 0:
        per_pair = per_pair - sft_coef * chosen_logp.to(dtype) / chosen_len.to(dtype).clamp(min=1)
    norm = w.sum().clamp(min=1) if num_pairs is None else num_pairs
    loss = (per_pair * w).sum() / norm
    chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    count = w.sum()

    def mean(x: Tensor) -> Tensor:
        return (x.to(dtype) * w).sum() / count.clamp(min=1)

    values = {"dpo/reward_accuracy": mean(chosen_reward > rejected_reward),
              "dpo/reward_margin": mean(chosen_reward - rejected_reward),
              "dpo/chosen_reward": mean(chosen_reward), "dpo/rejected_reward": mean(rejected_reward),
              "loss/dpo": loss.detach(), "dpo/num_pairs": count}
    host = torch.stack([v.detach().to(torch.float64) for v in values.values()]).tolist()
    return loss, dict(zip(values, host))


# --- value-based RL: the critic's loss and VAPO's positive-example LM term ---------


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip: float | None = 0.2, global_num_tokens: Count | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss 0.5·max((V − R)², (clip(V, V_old ± ε_v) − R)²), token-mean.

    values: `[B, T]` V of the critic being trained (carries the gradient); old_values:
    `[B, T]` V before the step's critic updates; returns: `[B, T]` targets R; mask: `[B, T]`.
    `clip=None` drops the clipped branch. `global_num_tokens`: the token count of the
    whole step (all microbatches and DP ranks), so pieces add up to the whole batch's loss.
    Metrics: `critic/value_loss` (this piece's share), `critic/value_clip_frac` (tokens where
    the clipped branch is larger, so its gradient is cut), `loss/num_tokens`.
    """
    require(values.shape == old_values.shape == returns.shape == mask.shape, "value_loss", "shapes",
            (tuple(values.shape), tuple(old_values.shape), tuple(returns.shape), tuple(mask.shape)),
            "four equal [B, T]")
    require(clip is None or clip > 0, "value_loss", "clip", clip, "None or > 0")
    m = mask.bool()
    dtype = torch.promote_types(values.dtype, torch.float32)
    v, old, ret = values.to(dtype), old_values.detach().to(dtype), returns.detach().to(dtype)
    loss_tok = (v - ret).square()
    clipped = torch.zeros_like(m)
    if clip is not None:
        clipped_sq = (old + (v - old).clamp(-clip, clip) - ret).square()
        clipped = (clipped_sq > loss_tok).detach()
        loss_tok = torch.maximum(loss_tok, clipped_sq)
    loss = 0.5 * aggregate(loss_tok, m, "token-mean", global_num_tokens=global_num_tokens)
    metrics = torch.stack([loss.detach().to(torch.float64), masked_mean(clipped.to(dtype), m).to(torch.float64),
                           m.sum().to(torch.float64)]).tolist()
    return loss, dict(zip(("critic/value_loss", "critic/value_clip_frac", "loss/num_tokens"), metrics))


def ntp_loss(logp: Tensor, mask: Tensor, correct: Tensor, *,
             global_num_tokens: Count | None = None) -> Tensor:
    """VAPO's positive-example LM loss L_NTP = −(1/N)·Σ_{i correct} Σ_t log π_θ(y_{i,t}).

    logp: `[B, T]` (carries the gradient); mask: `[B, T]` response tokens; correct: `[B]`
    bool (the sample's answer was right). N is the number of response tokens of correct
    samples in the whole step (`global_num_tokens`; default this piece's), so L_NTP is the
    mean negative log-likelihood over those tokens and pieces add up to the whole batch's.
    """
    require(logp.dim() == 2 and mask.shape == logp.shape and tuple(correct.shape) == logp.shape[:1],
            "ntp_loss", "shapes", (tuple(logp.shape), tuple(mask.shape), tuple(correct.shape)),
            "[B, T], [B, T] and [B]")
    m = mask.bool() & correct.bool()[:, None]
    return -aggregate(logp.to(torch.promote_types(logp.dtype, torch.float32)), m, "token-mean",
                      global_num_tokens=global_num_tokens)
